// Runs unchanged CUDA C++ kernels on the CPU: the engine's "cuda-shim" attention backend and the
// kernel tests on machines without a GPU.
//
// A CTA's CUDA threads run either as fibers (the default: cuda_cpu_fibers.h, cooperative threads
// that switch only at barriers, CTAs spread over a pool of OS threads) or as one std::thread each
// (GENQ_SHIM_THREADS: cuda_cpu_threads.h, for ThreadSanitizer, which then sees the same
// happens-before edges a GPU guarantees and reports accesses CUDA would leave unordered).
//
// Both give the same semantics: __syncthreads is a barrier over the CTA; warp shuffles exchange
// values through a per-warp slot array between two arrivals at a per-warp barrier (width 32, full
// mask); __shared__ variables live once per CTA in flight; a thread that returns early drops out
// of both barriers, as an exited thread does on sm_70+.
#pragma once

#include <math.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
};

struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};

// Per OS thread. Fibers do not migrate between OS threads, and the fiber scheduler sets
// threadIdx (and the shim's per-thread state below) before it resumes each fiber. Internal
// linkage (the header is included once per binary): a shared library then reaches them all
// through one TLS block address per function instead of a __tls_get_addr call per variable.
#define GENQ_SHIM_TLS static thread_local
GENQ_SHIM_TLS dim3 threadIdx;
GENQ_SHIM_TLS dim3 blockIdx;
GENQ_SHIM_TLS dim3 blockDim;
GENQ_SHIM_TLS dim3 gridDim;
constexpr int warpSize = 32;

inline float __uint_as_float(unsigned int u) { return std::bit_cast<float>(u); }
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline unsigned int __float_as_uint(float f) { return std::bit_cast<unsigned int>(f); }
inline int __float_as_int(float f) { return std::bit_cast<int>(f); }

namespace cuda_shim {
GENQ_SHIM_TLS int linear_tid = 0;
GENQ_SHIM_TLS int shuffle_parity = 0;
}  // namespace cuda_shim

#if defined(GENQ_SHIM_THREADS)
#define __shared__ static
#include "cuda_cpu_threads.h"
#else
#define __shared__ static thread_local  // one OS thread runs one CTA at a time
#include "cuda_cpu_fibers.h"
#endif

namespace cuda_shim {

// Double-buffered slots: shuffle k writes buffer k % 2, so one barrier per shuffle suffices. A lane
// that writes buffer k % 2 again (shuffle k + 2) has passed the barrier of shuffle k + 1, which
// every lane reaches only after its read of shuffle k.
template <typename T, typename SrcLane>
T shuffle(T value, SrcLane src_lane) {
  static_assert(sizeof(T) <= sizeof(std::uint64_t) && std::is_trivially_copyable_v<T>);
  Cta& cta = *current_cta;
  const int warp = linear_tid / 32;
  const int lane = linear_tid % 32;
  const int lanes = cta.num_threads - warp * 32;
  std::vector<std::uint64_t>& slots = cta.slots[shuffle_parity];
  shuffle_parity ^= 1;
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  slots[linear_tid] = bits;
  cta.sync_warp(warp);  // every lane's value written
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

}  // namespace cuda_shim

inline void __syncthreads() { cuda_shim::current_cta->sync(); }

inline void __syncwarp(unsigned int mask = 0xffffffffu) {
  cuda_shim::check_mask(mask);
  cuda_shim::current_cta->sync_warp(cuda_shim::linear_tid / 32);
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
    if (width == 32) return src;  // (no division on the path every reduction takes)
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
