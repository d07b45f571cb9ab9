// The shim's ThreadSanitizer executor (included by cuda_cpu_shim.h under GENQ_SHIM_THREADS): the
// CTAs of a grid run one after another, a CTA as one std::thread per CUDA thread. __syncthreads is
// a std::barrier over the CTA and each warp has its own; __shared__ variables are function-local
// statics: one copy, used by one CTA at a time, which is exactly the lifetime shared memory has.
// Every cross-thread hand-off goes through std::barrier (atomics), which TSan understands.
#pragma once

#include <barrier>
#include <exception>
#include <memory>
#include <thread>

namespace cuda_shim {

struct Cta {
  explicit Cta(int n)
      : num_threads(n), slots{std::vector<std::uint64_t>(n), std::vector<std::uint64_t>(n)},
        all(n) {
    for (int first = 0; first < n; first += 32) {
      warps.push_back(std::make_unique<std::barrier<>>(n - first < 32 ? n - first : 32));
    }
  }
  void sync() { all.arrive_and_wait(); }
  void sync_warp(int warp) { warps[warp]->arrive_and_wait(); }

  int num_threads;
  std::vector<std::uint64_t> slots[2];  // two shuffle slots per thread (see shuffle)
  std::barrier<> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
};

GENQ_SHIM_TLS Cta* current_cta = nullptr;

// Runs kernel over grid x block, CTA by CTA. Exceptions thrown by threads are rethrown here.
template <typename... Params, typename... Args>
void launch(dim3 grid, dim3 block, void (*kernel)(Params...), Args... args) {
  const int num_threads = static_cast<int>(block.x * block.y * block.z);
  for (unsigned int bz = 0; bz < grid.z; ++bz) {
    for (unsigned int by = 0; by < grid.y; ++by) {
      for (unsigned int bx = 0; bx < grid.x; ++bx) {
        Cta cta(num_threads);
        std::vector<std::thread> threads;
        threads.reserve(num_threads);
        std::vector<std::exception_ptr> errors(num_threads);
        for (int t = 0; t < num_threads; ++t) {
          threads.emplace_back([&, t] {
            current_cta = &cta;
            linear_tid = t;
            shuffle_parity = 0;
            threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
            blockIdx = dim3(bx, by, bz);
            blockDim = block;
            gridDim = grid;
            try {
              kernel(args...);
            } catch (...) {
              errors[t] = std::current_exception();
            }
            cta.warps[t / 32]->arrive_and_drop();
            cta.all.arrive_and_drop();
          });
        }
        for (auto& thread : threads) thread.join();
        for (auto& error : errors) {
          if (error) std::rethrow_exception(error);
        }
      }
    }
  }
}

}  // namespace cuda_shim
