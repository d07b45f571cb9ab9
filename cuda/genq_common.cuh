// Device helpers shared by genq's kernels: storage types, 16-byte vector loads, warp reductions.
//
// No system headers anywhere in cuda/: NVRTC compiles these sources without any, and the CPU shim
// (tests/kernels/shim) compiles the same text with g++. Code that only a GPU can run (inline PTX)
// sits behind __CUDA_ARCH__ with a portable twin that the shim runs and the tests check bit for bit.
#pragma once

namespace genq {

// 16-bit storage types. Kernels convert to float on load and accumulate in fp32.
struct half_t {
  unsigned short bits;
};
struct bf16_t {
  unsigned short bits;
};

constexpr unsigned int kFullMask = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ int min_int(int a, int b) { return a < b ? a : b; }

__device__ __forceinline__ float half_bits_to_float(unsigned int h) {
#if defined(__CUDA_ARCH__)
  float f;
  const unsigned short hs = static_cast<unsigned short>(h);
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(hs));
  return f;
#else
  const unsigned int sign = (h & 0x8000u) << 16;
  const unsigned int exponent = (h >> 10) & 0x1fu;
  const unsigned int mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return __uint_as_float(__float_as_uint(magnitude) | sign);
  }
  if (exponent == 31) {  // inf, or NaN made quiet (as x86 and torch do)
    return __uint_as_float(sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0u));
  }
  return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
#endif
}

// Round to nearest even, like cvt.rn.f16.f32 and torch's Tensor.half().
__device__ __forceinline__ unsigned short float_to_half_bits(float f) {
#if defined(__CUDA_ARCH__)
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  const unsigned int x = __float_as_uint(f);
  const unsigned int sign = (x >> 16) & 0x8000u;
  const unsigned int ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<unsigned short>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  if (ax >= 0x47800000u) return static_cast<unsigned short>(sign | 0x7c00u);  // >= 2^16: inf
  if (ax < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    if (ax <= 0x33000000u) return static_cast<unsigned short>(sign);  // <= 2^-25 rounds to 0
    const unsigned int mantissa = (ax & 0x7fffffu) | 0x800000u;
    const unsigned int shift = 126u - (ax >> 23);  // 14..24
    unsigned int h = mantissa >> shift;
    const unsigned int rest = mantissa & ((1u << shift) - 1u);
    const unsigned int halfway = 1u << (shift - 1u);
    if (rest > halfway || (rest == halfway && (h & 1u))) ++h;
    return static_cast<unsigned short>(sign | h);
  }
  unsigned int h = (ax - 0x38000000u) >> 13;  // rebias the exponent 127 -> 15
  const unsigned int rest = ax & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry may round up to inf
  return static_cast<unsigned short>(sign | h);
#endif
}

__device__ __forceinline__ float bf16_bits_to_float(unsigned int b) {
  return __uint_as_float(b << 16);
}

// Round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ unsigned short float_to_bf16_bits(float f) {
  const unsigned int x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((x >> 16) | 0x40u);
  return static_cast<unsigned short>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// DType<T>: kVec elements of T fill one 16-byte vector; unpack converts such a vector to floats.
template <typename T>
struct DType;

template <>
struct DType<float> {
  static constexpr int kVec = 4;
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  __device__ __forceinline__ static float from_float(float f) { return f; }
};

template <>
struct DType<half_t> {
  static constexpr int kVec = 8;
  __device__ __forceinline__ static void unpack_word(unsigned int w, float* f) {
    f[0] = half_bits_to_float(w & 0xffffu);  // little endian: the lower address is the low half
    f[1] = half_bits_to_float(w >> 16);
  }
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    unpack_word(v.x, f);
    unpack_word(v.y, f + 2);
    unpack_word(v.z, f + 4);
    unpack_word(v.w, f + 6);
  }
  __device__ __forceinline__ static half_t from_float(float f) {
    half_t h;
    h.bits = float_to_half_bits(f);
    return h;
  }
};

template <>
struct DType<bf16_t> {
  static constexpr int kVec = 8;
  __device__ __forceinline__ static void unpack_word(unsigned int w, float* f) {
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xffff0000u);
  }
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    unpack_word(v.x, f);
    unpack_word(v.y, f + 2);
    unpack_word(v.z, f + 4);
    unpack_word(v.w, f + 6);
  }
  __device__ __forceinline__ static bf16_t from_float(float f) {
    bf16_t b;
    b.bits = float_to_bf16_bits(f);
    return b;
  }
};

// Loads DType<T>::kVec elements starting at p (16-byte aligned) as floats.
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float* f) {
  DType<T>::unpack(*reinterpret_cast<const uint4*>(p), f);
}

// Sum over the GROUP lanes of an aligned lane group (GROUP a power of two <= 32). Every lane of the
// warp must call it (full-mask shuffles).
template <int GROUP>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int offset = GROUP / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

__device__ __forceinline__ float warp_sum(float v) { return group_sum<32>(v); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Reduction over the whole CTA through `scratch` (one float per warp). Ends with a barrier, after
// which every thread holds the result; a later reduction must use a different scratch array.
template <int WARPS>
__device__ __forceinline__ float block_max(float v, float* scratch) {
  v = warp_max(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();  // every warp's partial result visible
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < WARPS; ++w) r = fmaxf(r, scratch[w]);
  return r;
}

template <int WARPS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();  // every warp's partial result visible
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < WARPS; ++w) r += scratch[w];
  return r;
}

}  // namespace genq
