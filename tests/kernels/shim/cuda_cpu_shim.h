// Runs unchanged CUDA C++ kernels on the CPU, for tests on machines without a GPU.
//
// Execution model: the CTAs of a grid run one after another; a CTA runs as one std::thread per CUDA
// thread. __syncthreads is a std::barrier over the CTA, warp shuffles exchange values through a
// per-warp slot array between two arrivals at a per-warp std::barrier (width 32, full mask), and
// __shared__ variables are function-local statics: one copy, used by one CTA at a time, which is
// exactly the lifetime shared memory has. A thread that returns early drops out of both barriers,
// as an exited thread does on sm_70+.
//
// Every cross-thread hand-off goes through std::barrier (atomics), so ThreadSanitizer sees the same
// happens-before edges a GPU guarantees, and reports accesses that CUDA would leave unordered.
#pragma once

#include <math.h>

#include <barrier>
#include <bit>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
};

struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;

inline float __uint_as_float(unsigned int u) { return std::bit_cast<float>(u); }
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline unsigned int __float_as_uint(float f) { return std::bit_cast<unsigned int>(f); }
inline int __float_as_int(float f) { return std::bit_cast<int>(f); }

namespace cuda_shim {

struct Cta {
  explicit Cta(int num_threads)
      : sync(num_threads), slots{std::vector<std::uint64_t>(num_threads),
                                 std::vector<std::uint64_t>(num_threads)} {
    for (int first = 0; first < num_threads; first += 32) {
      const int lanes = num_threads - first < 32 ? num_threads - first : 32;
      warp_sync.push_back(std::make_unique<std::barrier<>>(lanes));
    }
  }
  std::barrier<> sync;
  std::vector<std::unique_ptr<std::barrier<>>> warp_sync;
  std::vector<std::uint64_t> slots[2];  // two shuffle slots per thread (see shuffle)
};

inline thread_local Cta* current_cta = nullptr;
inline thread_local int linear_tid = 0;
inline thread_local int shuffle_parity = 0;

// Double-buffered slots: shuffle k writes buffer k % 2, so one barrier per shuffle suffices. A lane
// that writes buffer k % 2 again (shuffle k + 2) has passed the barrier of shuffle k + 1, which
// every lane reaches only after its read of shuffle k.
template <typename T, typename SrcLane>
T shuffle(T value, SrcLane src_lane) {
  static_assert(sizeof(T) <= sizeof(std::uint64_t) && std::is_trivially_copyable_v<T>);
  Cta& cta = *current_cta;
  const int warp = linear_tid / 32;
  const int lane = linear_tid % 32;
  const int lanes = static_cast<int>(cta.slots[0].size()) - warp * 32;
  std::vector<std::uint64_t>& slots = cta.slots[shuffle_parity];
  shuffle_parity ^= 1;
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  slots[linear_tid] = bits;
  cta.warp_sync[warp]->arrive_and_wait();  // every lane's value written
  int src = src_lane(lane);
  if (src < 0 || src >= (lanes < 32 ? lanes : 32)) src = lane;
  T result;
  bits = slots[warp * 32 + src];
  std::memcpy(&result, &bits, sizeof(T));
  return result;
}

inline void check_mask(unsigned int mask) {
  if (mask != 0xffffffffu) throw std::logic_error("cuda_cpu_shim supports full-warp masks only");
}

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
            cta.warp_sync[t / 32]->arrive_and_drop();
            cta.sync.arrive_and_drop();
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

inline void __syncthreads() { cuda_shim::current_cta->sync.arrive_and_wait(); }

inline void __syncwarp(unsigned int mask = 0xffffffffu) {
  cuda_shim::check_mask(mask);
  cuda_shim::current_cta->warp_sync[cuda_shim::linear_tid / 32]->arrive_and_wait();
}

template <typename T>
T __shfl_sync(unsigned int mask, T value, int src_lane, int width = 32) {
  cuda_shim::check_mask(mask);
  return cuda_shim::shuffle(value, [&](int lane) {
    return (lane / width) * width + (src_lane % width);
  });
}

template <typename T>
T __shfl_xor_sync(unsigned int mask, T value, int lane_mask, int width = 32) {
  cuda_shim::check_mask(mask);
  return cuda_shim::shuffle(value, [&](int lane) {
    const int src = lane ^ lane_mask;
    return src / width == lane / width ? src : lane;
  });
}

template <typename T>
T __shfl_down_sync(unsigned int mask, T value, unsigned int delta, int width = 32) {
  cuda_shim::check_mask(mask);
  return cuda_shim::shuffle(value, [&](int lane) {
    const int src = lane + static_cast<int>(delta);
    return src / width == lane / width ? src : lane;
  });
}
