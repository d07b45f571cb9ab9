// Cache maintenance kernels. They move whole 16-byte vectors, so one instance serves every dtype:
// a head is always a whole number of vectors (engine/kernels.py checks pointers and strides).
//
// reshape_and_cache: one CTA per new token writes its K and V rows ([num_kv_heads * HEAD_SIZE]
// elements each) into slot slot_mapping[token] of the layer's key and value cache; slot -1 (a padding
// token) writes nothing.
//
// copy_blocks: grid (num_pairs, num_planes); a plane is one layer's K or V cache, so one launch
// copies every layer. pairs[i] = (src block, dst block). Source and destination may be the same
// cache (copy-on-write) or two caches with different block counts (swap between the device cache
// and pinned host memory, which the GPU reads and writes through unified addressing).
#pragma once

#include "genq_common.cuh"

namespace genq {

constexpr int kCacheThreads = 128;

__global__ void __launch_bounds__(kCacheThreads, 1) reshape_and_cache_kernel(
    const uint4* __restrict__ key,           // [num_tokens, ...], rows key_stride vectors apart
    const uint4* __restrict__ value,         // [num_tokens, ...], rows value_stride vectors apart
    uint4* __restrict__ key_cache,           // [num_slots, row_vecs]
    uint4* __restrict__ value_cache,         // [num_slots, row_vecs]
    const long long* __restrict__ slot_mapping,  // [num_tokens]
    int row_vecs, long long key_stride, long long value_stride) {
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;  // padding token: nothing to cache
  for (int i = threadIdx.x; i < row_vecs; i += kCacheThreads) {
    key_cache[slot * row_vecs + i] = key[token * key_stride + i];
    value_cache[slot * row_vecs + i] = value[token * value_stride + i];
  }
}

// No __restrict__: src and dst are the same buffer for copy-on-write (disjoint blocks).
__global__ void __launch_bounds__(kCacheThreads, 1) copy_blocks_kernel(
    const uint4* src,                     // [num_planes, src_blocks, block_vecs]
    uint4* dst,                           // [num_planes, dst_blocks, block_vecs]
    const long long* __restrict__ pairs,  // [num_pairs, 2]
    long long src_plane_stride, long long dst_plane_stride, long long block_vecs) {
  const long long plane = blockIdx.y;
  const uint4* from = src + plane * src_plane_stride + pairs[2 * blockIdx.x] * block_vecs;
  uint4* to = dst + plane * dst_plane_stride + pairs[2 * blockIdx.x + 1] * block_vecs;
  for (long long i = threadIdx.x; i < block_vecs; i += kCacheThreads) to[i] = from[i];
}

}  // namespace genq
