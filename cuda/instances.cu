// Every kernel variant the engine can launch, explicitly instantiated, so that
// `nvcc -cubin cuda/instances.cu` compiles (and ptxas reports on) exactly what runs.
// engine/kernels.py names the same set (tests/kernels/test_compile.py holds them equal).
#include "paged_attention.cu"
#include "cache_kernels.cu"

namespace genq {

#define GENQ_DECODE(T, HEAD, BLOCK)                                                          \
  template __global__ void paged_attention_decode_kernel<T, HEAD, BLOCK>(                    \
      T*, float*, float*, float*, const T*, const T*, const T*, const int*, const int*, int, \
      int, int, int, float, int);

#define GENQ_PREFILL(T, HEAD, BLOCK)                                                         \
  template __global__ void paged_attention_prefill_kernel<T, HEAD, BLOCK>(                   \
      T*, const T*, const T*, const T*, const int*, const int*, const int*, int, int, int,   \
      int, float);

#define GENQ_REDUCE(T, HEAD)                                                                 \
  template __global__ void paged_attention_reduce_kernel<T, HEAD>(                           \
      T*, const float*, const float*, const float*, const int*, int);

#define GENQ_PER_BLOCK(T, HEAD) \
  GENQ_DECODE(T, HEAD, 8)       \
  GENQ_DECODE(T, HEAD, 16)      \
  GENQ_DECODE(T, HEAD, 32)      \
  GENQ_PREFILL(T, HEAD, 8)      \
  GENQ_PREFILL(T, HEAD, 16)     \
  GENQ_PREFILL(T, HEAD, 32)     \
  GENQ_REDUCE(T, HEAD)

#define GENQ_PER_HEAD(T)   \
  GENQ_PER_BLOCK(T, 64)    \
  GENQ_PER_BLOCK(T, 80)    \
  GENQ_PER_BLOCK(T, 96)    \
  GENQ_PER_BLOCK(T, 128)   \
  GENQ_PER_BLOCK(T, 256)

GENQ_PER_HEAD(float)
GENQ_PER_HEAD(half_t)
GENQ_PER_HEAD(bf16_t)

}  // namespace genq
