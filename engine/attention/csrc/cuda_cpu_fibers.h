// The shim's default executor (included by cuda_cpu_shim.h): the CUDA threads of a CTA are fibers
// on one OS thread, and a grid's CTAs are spread over a pool of OS threads.
//
// A fiber runs until it waits at a barrier (__syncthreads, a shuffle's warp barrier) and then
// switches to the next live fiber of its CTA, round-robin in thread order. So a barrier costs
// one stack switch per thread, not an OS context switch, and a launch starts no thread. Fibers and their stacks persist per OS thread and are reused by every CTA it runs.
// A round in which no fiber arrives anywhere or exits is a deadlock (a kernel with threads at
// different barriers) and raises std::logic_error, as a hang on a GPU would be a bug.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <functional>

#include "cuda_cpu_pool.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace cuda_shim {

// ---- stack switching ----------------------------------------------------------------------------
#if defined(__x86_64__)
// Saves the System V callee-saved registers on the current stack, stores its stack pointer in
// *save, loads `load` and pops the registers saved there (a fresh stack holds zeros and the
// fiber's entry point as the return address).
extern "C" void genq_shim_switch(void** save, void* load);
asm(R"(
  .pushsection .text
  .weak genq_shim_switch
  .hidden genq_shim_switch
  .type genq_shim_switch, @function
genq_shim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size genq_shim_switch, .-genq_shim_switch
  .popsection
)");
struct Context {
  void* sp = nullptr;
  void start(char* stack, std::size_t size, void (*entry)()) {
    // At entry (rsp + 8) % 16 == 0, as after a call; the return address slot holds 0.
    void** top = reinterpret_cast<void**>(
        (reinterpret_cast<std::uintptr_t>(stack + size) & ~std::uintptr_t{15}));
    *--top = nullptr;
    *--top = reinterpret_cast<void*>(entry);
    for (int i = 0; i < 6; ++i) *--top = nullptr;
    sp = top;
  }
  void switch_to(Context& next) { genq_shim_switch(&sp, next.sp); }
};
#else  // portable: ucontext (slower: swapcontext also saves the signal mask)
struct Context {
  ucontext_t uc;
  void start(char* stack, std::size_t size, void (*entry)()) {
    getcontext(&uc);
    uc.uc_stack.ss_sp = stack;
    uc.uc_stack.ss_size = size;
    uc.uc_link = nullptr;
    makecontext(&uc, entry, 0);
  }
  void switch_to(Context& next) { swapcontext(&uc, &next.uc); }
};
#endif

// ---- barriers and the CTA ---------------------------------------------------------------------
void yield();
GENQ_SHIM_TLS std::uint64_t progress = 0;  // arrivals and exits, for deadlock detection

struct Barrier {
  int expected = 0, arrived = 0;
  unsigned int phase = 0;
  void wait() {
    ++progress;
    const unsigned int my_phase = phase;
    if (++arrived == expected) {
      arrived = 0;
      ++phase;
      return;
    }
    while (phase == my_phase) yield();
  }
  void drop() {  // an exited thread: the current and later phases expect one fewer arrival
    ++progress;
    if (--expected > 0 && arrived == expected) {
      arrived = 0;
      ++phase;
    }
  }
};

struct Cta {
  void reset(int n) {
    num_threads = n;
    for (auto& s : slots) s.assign(n, 0);
    all = Barrier{n};
    warps.assign((n + 31) / 32, Barrier{});
    for (int w = 0; w < static_cast<int>(warps.size()); ++w) warps[w].expected = std::min(32, n - 32 * w);
  }
  void sync() { all.wait(); }
  void sync_warp(int warp) { warps[warp].wait(); }

  int num_threads = 0;
  std::vector<std::uint64_t> slots[2];  // two shuffle slots per thread (see shuffle)
  Barrier all;
  std::vector<Barrier> warps;
};

GENQ_SHIM_TLS Cta* current_cta = nullptr;

// ---- one OS thread's fibers --------------------------------------------------------------------
class Executor {
 public:
  static constexpr std::size_t kStackSize = 256 * 1024;

  ~Executor() { discard(); }

  // Runs one CTA to completion on this OS thread; rethrows what a CUDA thread threw.
  void run(dim3 grid, dim3 block, dim3 index, const std::function<void()>& body) {
    const int n = static_cast<int>(block.x * block.y * block.z);
    while (static_cast<int>(fibers_.size()) < n) add_fiber();
    cta_.reset(n);
    body_ = &body;
    error_ = nullptr;
    deadlocked_ = false;
    current_cta = &cta_;
    blockIdx = index;
    blockDim = block;
    gridDim = grid;
    for (int t = 0; t < n; ++t) {  // the live fibers form a ring in thread order
      Fiber& f = fibers_[t];
      f.done = false;
      f.parity = 0;
      f.index = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
      f.next = (t + 1) % n;
      f.prev = (t + n - 1) % n;
    }
    live_ = n;
    round_mark_ = progress;
    enter(0);
    scheduler_.switch_to(fibers_[0].context);  // back when every fiber exited, or on deadlock
    if (deadlocked_) {
      discard();  // the stuck fibers' stacks cannot be resumed for another CTA
      throw std::logic_error("cuda_cpu_shim: deadlock, threads wait at different barriers");
    }
    if (error_) std::rethrow_exception(error_);
  }

  // A fiber that waits hands over to the next live fiber. A whole round of the ring in which no
  // fiber arrived anywhere or exited is a deadlock.
  void yield() {
    Fiber& f = fibers_[current_];
    if (f.next <= current_) {
      if (progress == round_mark_) {
        deadlocked_ = true;
        f.context.switch_to(scheduler_);
      }
      round_mark_ = progress;
    }
    f.parity = shuffle_parity;
    enter(f.next);
    f.context.switch_to(fibers_[f.next].context);
  }

  static Executor& local() {
    thread_local Executor executor;
    return executor;
  }

 private:
  struct Fiber {
    Context context;
    char* stack = nullptr;
    dim3 index;
    int parity = 0;
    int next = 0, prev = 0;  // the ring of live fibers
    bool done = true;
  };

  // Makes fiber t current: the thread-local state its CUDA thread reads.
  void enter(int t) {
    current_ = t;
    linear_tid = t;
    threadIdx = fibers_[t].index;
    shuffle_parity = fibers_[t].parity;
  }

  [[noreturn]] static void entry() {
    Executor& self = local();
    for (;;) {
      try {
        (*self.body_)();
      } catch (...) {
        if (!self.error_) self.error_ = std::current_exception();
      }
      self.cta_.warps[linear_tid / 32].drop();
      self.cta_.all.drop();
      const int t = self.current_;
      Fiber& f = self.fibers_[t];
      f.done = true;
      self.fibers_[f.prev].next = f.next;
      self.fibers_[f.next].prev = f.prev;
      if (--self.live_ == 0) {
        f.context.switch_to(self.scheduler_);
      } else {
        self.enter(f.next);
        f.context.switch_to(self.fibers_[f.next].context);
      }
      // Resumed for the next CTA: run the body again.
    }
  }
  void add_fiber() {
    const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    void* mem = mmap(nullptr, kStackSize + page, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) throw std::runtime_error("cuda_cpu_shim: no memory for a fiber stack");
    mprotect(mem, page, PROT_NONE);  // guard page: an overflow faults instead of corrupting
    fibers_.emplace_back();
    Fiber& f = fibers_.back();
    f.stack = static_cast<char*>(mem);
    f.context.start(f.stack + page, kStackSize, &Executor::entry);
  }

  void discard() {
    const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    for (Fiber& f : fibers_) munmap(f.stack, kStackSize + page);
    fibers_.clear();
  }

  std::vector<Fiber> fibers_;
  Context scheduler_;
  Cta cta_;
  int current_ = 0, live_ = 0;
  std::uint64_t round_mark_ = 0;
  bool deadlocked_ = false;
  const std::function<void()>* body_ = nullptr;
  std::exception_ptr error_;
};

inline void yield() { Executor::local().yield(); }

// Runs kernel over grid x block. Exceptions thrown by CUDA threads are rethrown here.
template <typename... Params, typename... Args>
void launch(dim3 grid, dim3 block, void (*kernel)(Params...), Args... args) {
  const std::function<void()> body = [&] { kernel(args...); };
  const long long per_plane = static_cast<long long>(grid.x) * grid.y;
  Pool::get().run(per_plane * grid.z, [&](long long i) {
    const dim3 index(static_cast<unsigned int>(i % grid.x),
                     static_cast<unsigned int>(i / grid.x % grid.y),
                     static_cast<unsigned int>(i / per_plane));
    Executor::local().run(grid, block, index, body);
  });
}

}  // namespace cuda_shim
