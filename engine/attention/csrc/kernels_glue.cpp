// C entry points over the unchanged cuda/ sources, compiled with g++ against cuda_cpu_shim.h and
// called through ctypes by engine/attention/cuda_shim.py: genq_launch executes the kernel
// parameters that engine/kernels.py marshals (kernel name expression, grid, block, parameters) as
// cuLaunchKernel would.
#include "cuda_cpu_shim.h"

#include "paged_attention.cu"
#include "cache_kernels.cu"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <utility>

// (type, head size, block size) compiled into the shim. The engine builds one variant per library
// (-DGENQ_SHIM_VARIANTS(X)=X(float,64,16)); this default list is the kernel tests' build, in which
// every dtype, head size and block size appears at least once.
#ifndef GENQ_SHIM_VARIANTS
#define GENQ_SHIM_VARIANTS(X)        \
  X(float, 64, 8)                 \
  X(float, 64, 16)                \
  X(float, 64, 32)                \
  X(float, 80, 16)                \
  X(float, 96, 32)                \
  X(float, 128, 16)               \
  X(float, 256, 8)                \
  X(genq::half_t, 64, 16)         \
  X(genq::half_t, 96, 8)          \
  X(genq::bf16_t, 80, 8)          \
  X(genq::bf16_t, 128, 32)
#endif

namespace {

// Unpacks cuLaunchKernel-style parameters (params[i] points at the i-th argument) after checking
// that the caller sized every argument exactly as the kernel declares it.
template <typename... P, std::size_t... I>
int launch_packed(void (*kernel)(P...), dim3 grid, dim3 block, void** params, const int* sizes,
                  int num_params, std::index_sequence<I...>) {
  const int expected[] = {static_cast<int>(sizeof(P))...};
  if (num_params != static_cast<int>(sizeof...(P))) {
    std::fprintf(stderr, "kernel takes %d parameters, got %d\n", static_cast<int>(sizeof...(P)),
                 num_params);
    return -3;
  }
  for (int i = 0; i < num_params; ++i) {
    if (sizes[i] != expected[i]) {
      std::fprintf(stderr, "parameter %d is %d bytes, got %d\n", i, expected[i], sizes[i]);
      return -3;
    }
  }
  try {
    cuda_shim::launch(grid, block, kernel, *static_cast<std::remove_cv_t<P>*>(params[I])...);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kernel thread threw: %s\n", e.what());
    return -2;
  }
}

template <typename... P>
int launch_packed(void (*kernel)(P...), dim3 grid, dim3 block, void** params, const int* sizes,
                  int num_params) {
  return launch_packed(kernel, grid, block, params, sizes, num_params,
                       std::index_sequence_for<P...>{});
}

struct Entry {
  const char* name;
  int (*launch)(dim3, dim3, void**, const int*, int);
};

#define GENQ_ENTRY(NAME, ...)                                                  \
  Entry{NAME, [](dim3 g, dim3 b, void** p, const int* s, int n) {              \
          return launch_packed(__VA_ARGS__, g, b, p, s, n);                    \
        }},
#define GENQ_VARIANT_ENTRIES(T, HEAD, BLOCK)                                               \
  GENQ_ENTRY("genq::paged_attention_decode_kernel<" #T ", " #HEAD ", " #BLOCK ">",         \
             genq::paged_attention_decode_kernel<T, HEAD, BLOCK>)                          \
  GENQ_ENTRY("genq::paged_attention_prefill_kernel<" #T ", " #HEAD ", " #BLOCK ">",        \
             genq::paged_attention_prefill_kernel<T, HEAD, BLOCK>)                         \
  GENQ_ENTRY("genq::paged_attention_reduce_kernel<" #T ", " #HEAD ">",                     \
             genq::paged_attention_reduce_kernel<T, HEAD>)

const Entry kEntries[] = {
    GENQ_SHIM_VARIANTS(GENQ_VARIANT_ENTRIES)
    GENQ_ENTRY("genq::reshape_and_cache_kernel", genq::reshape_and_cache_kernel)
    GENQ_ENTRY("genq::copy_blocks_kernel", genq::copy_blocks_kernel)
};

const Entry* find(const char* name) {
  for (const Entry& e : kEntries) {
    if (std::strcmp(e.name, name) == 0) return &e;
  }
  return nullptr;
}

}  // namespace

// Shim libraries are built with -fvisibility=hidden: the engine loads one per variant into one
// process, and each must keep its own executor and thread-locals (the dynamic linker would
// otherwise bind every library's inline functions to the first library's). Only these C entry
// points are exported.
#define GENQ_EXPORT __attribute__((visibility("default")))

extern "C" {

GENQ_EXPORT int genq_has_kernel(const char* name) { return find(name) != nullptr; }

// Launches kernel `name` like cuLaunchKernel: 0 on success, -1 for a kernel this build lacks, -2
// when a kernel thread threw, -3 for a parameter list that does not match the kernel's. Parameter i
// is sizes[i] bytes at the start of the 8-byte slot packed + 8 * i (little-endian).
GENQ_EXPORT int genq_launch(const char* name, unsigned int gx, unsigned int gy, unsigned int gz,
                unsigned int bx, unsigned int by, unsigned int bz, const unsigned char* packed,
                const int* sizes, int num_params) {
  const Entry* e = find(name);
  if (e == nullptr) return -1;
  constexpr int kMaxParams = 32;
  if (num_params < 0 || num_params > kMaxParams) return -3;
  std::uint64_t slots[kMaxParams];
  void* params[kMaxParams];
  std::memcpy(slots, packed, sizeof(std::uint64_t) * num_params);
  for (int i = 0; i < num_params; ++i) params[i] = &slots[i];
  return e->launch(dim3(gx, gy, gz), dim3(bx, by, bz), params, sizes, num_params);
}

// OS threads that run a launch's CTAs (the caller included); ignored by the TSan build.
GENQ_EXPORT void genq_set_num_threads(int n) {
#if !defined(GENQ_SHIM_THREADS)
  cuda_shim::Pool::get().set_num_threads(n);
#else
  (void)n;
#endif
}

// The device-side conversions of cuda/genq_common.cuh, element by element (portable twins).
GENQ_EXPORT void genq_half_to_float(const unsigned short* in, float* out, long long n) {
  for (long long i = 0; i < n; ++i) out[i] = genq::half_bits_to_float(in[i]);
}
GENQ_EXPORT void genq_float_to_half(const float* in, unsigned short* out, long long n) {
  for (long long i = 0; i < n; ++i) out[i] = genq::float_to_half_bits(in[i]);
}
GENQ_EXPORT void genq_bf16_to_float(const unsigned short* in, float* out, long long n) {
  for (long long i = 0; i < n; ++i) out[i] = genq::bf16_bits_to_float(in[i]);
}
GENQ_EXPORT void genq_float_to_bf16(const float* in, unsigned short* out, long long n) {
  for (long long i = 0; i < n; ++i) out[i] = genq::float_to_bf16_bits(in[i]);
}

}  // extern "C"
