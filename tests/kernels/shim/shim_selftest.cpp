// The shim's own semantics, checked against what CUDA specifies: indices in 3-D grids, shared
// memory per CTA, __syncthreads ordering, the shuffle variants with their width and out-of-range
// rules, and threads that return before a barrier. Prints each failure; exit status 0 when none.
#include "cuda_cpu_shim.h"

#include <cstdio>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const char* what, int index, long long got, long long want) {
  if (!ok) {
    ++failures;
    std::printf("FAIL %s [%d]: got %lld, want %lld\n", what, index, got, want);
  }
}

__global__ void indices(int* out) {
  const int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  const int per_block = blockDim.x * blockDim.y * blockDim.z;
  out[block * per_block + thread] = block * 1000 + thread;
}

// Each CTA publishes its id in shared memory; every thread must read its own CTA's id.
__global__ void shared_per_block(int* out) {
  __shared__ int id;
  if (threadIdx.x == 0) id = static_cast<int>(blockIdx.x) + 7;
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = id;
}

// Neighbour exchange through shared memory across warps, twice (the buffer is reused).
__global__ void rotate(int* out) {
  __shared__ int buf[96];
  const int n = blockDim.x;
  buf[threadIdx.x] = threadIdx.x * 3;
  __syncthreads();
  int v = buf[(threadIdx.x + 1) % n];
  __syncthreads();
  buf[threadIdx.x] = v + 1;
  __syncthreads();
  out[threadIdx.x] = buf[(threadIdx.x + 40) % n];
}

__global__ void shuffles(int* xor_sum, int* bcast, int* bcast8, int* down, float* fsum) {
  const int lane = threadIdx.x % 32;
  int v = lane + 1;
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  xor_sum[threadIdx.x] = v;
  bcast[threadIdx.x] = __shfl_sync(0xffffffffu, lane * 10, 5);
  bcast8[threadIdx.x] = __shfl_sync(0xffffffffu, lane * 10, 3, 8);  // lane 3 of each 8-segment
  down[threadIdx.x] = __shfl_down_sync(0xffffffffu, lane, 4);
  float f = 0.5f * lane;
  for (int offset = 16; offset > 0; offset /= 2) f += __shfl_xor_sync(0xffffffffu, f, offset);
  fsum[threadIdx.x] = f;
}

// Threads 64.. return at once; the rest still meet at __syncthreads (exited threads drop out).
__global__ void early_exit(int* out) {
  __shared__ int buf[64];
  if (threadIdx.x >= 64) return;
  buf[threadIdx.x] = threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = buf[63 - threadIdx.x];
}

// Half of warp 0 waits at __syncthreads, the other half at __syncwarp: neither barrier can complete
// (a hang on a GPU). The fiber executor reports it; the OS-thread executor would hang, so only the
// fiber build runs it.
#if !defined(GENQ_SHIM_THREADS)
__global__ void mismatched_barriers(int* out) {
  if (threadIdx.x % 32 < 16) {
    __syncthreads();
  } else {
    __syncwarp();
  }
  out[threadIdx.x] = 1;
}
#endif

}  // namespace

int main() {
  {
    std::vector<int> out(2 * 3 * 2 * 4 * 2 * 3);
    cuda_shim::launch(dim3(2, 3, 2), dim3(4, 2, 3), indices, out.data());
    for (int i = 0; i < static_cast<int>(out.size()); ++i) {
      expect(out[i] == (i / 24) * 1000 + i % 24, "indices", i, out[i], (i / 24) * 1000 + i % 24);
    }
  }
  {
    std::vector<int> out(5 * 64);
    cuda_shim::launch(dim3(5), dim3(64), shared_per_block, out.data());
    for (int i = 0; i < 5 * 64; ++i) expect(out[i] == i / 64 + 7, "shared", i, out[i], i / 64 + 7);
  }
  {
    std::vector<int> out(96);
    cuda_shim::launch(dim3(1), dim3(96), rotate, out.data());
    for (int t = 0; t < 96; ++t) {
      const int want = ((t + 41) % 96) * 3 + 1;
      expect(out[t] == want, "rotate", t, out[t], want);
    }
  }
  {
    std::vector<int> xor_sum(64), bcast(64), bcast8(64), down(64);
    std::vector<float> fsum(64);
    cuda_shim::launch(dim3(1), dim3(64), shuffles, xor_sum.data(), bcast.data(), bcast8.data(),
                      down.data(), fsum.data());
    for (int t = 0; t < 64; ++t) {
      const int lane = t % 32;
      expect(xor_sum[t] == 528, "shfl_xor sum", t, xor_sum[t], 528);
      expect(bcast[t] == 50, "shfl broadcast", t, bcast[t], 50);
      expect(bcast8[t] == ((lane / 8) * 8 + 3) * 10, "shfl width 8", t, bcast8[t],
             ((lane / 8) * 8 + 3) * 10);
      const int want_down = lane + 4 < 32 ? lane + 4 : lane;
      expect(down[t] == want_down, "shfl_down", t, down[t], want_down);
      expect(fsum[t] == 248.f, "shfl_xor float", t, static_cast<long long>(fsum[t]), 248);
    }
  }
  {
    std::vector<int> out(64, -1);
    cuda_shim::launch(dim3(3), dim3(128), early_exit, out.data());
    for (int t = 0; t < 64; ++t) expect(out[t] == 63 - t, "early exit", t, out[t], 63 - t);
  }
#if !defined(GENQ_SHIM_THREADS)
  {
    std::vector<int> out(32, 0);
    bool reported = false;
    try {
      cuda_shim::launch(dim3(2), dim3(32), mismatched_barriers, out.data());
    } catch (const std::logic_error&) {
      reported = true;
    }
    expect(reported, "deadlock reported", 0, reported, 1);
    std::vector<int> again(2 * 64);  // the executor starts afresh after a deadlock
    cuda_shim::launch(dim3(2), dim3(64), shared_per_block, again.data());
    for (int i = 0; i < 2 * 64; ++i) {
      expect(again[i] == i / 64 + 7, "after deadlock", i, again[i], i / 64 + 7);
    }
  }
#endif
  std::printf("%s\n", failures ? "shim self-test failed" : "shim self-test passed");
  return failures ? 1 : 0;
}
