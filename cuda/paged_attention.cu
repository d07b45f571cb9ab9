// Paged attention over genq's KV cache layout (engine/attention/base.py):
//
//   key_cache, value_cache: [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE], T in {float, half,
//   bf16}; token t of a sequence lives in block block_tables[seq][t / BLOCK_SIZE], row t % BLOCK_SIZE.
//
// Decode (one query per sequence): grid (num_heads / heads_per_cta, num_seqs, max_num_partitions).
// A CTA serves heads_per_cta (1, 2 or 4) query heads of one KV head over one 512-token partition:
// its 4 warps split as heads_per_cta heads x (4 / heads_per_cta) token slices, so with GQA the
// sibling query heads read each K/V row at the same time from one SM (L1) instead of each CTA
// fetching it again from L2. A lane group of kGroup threads reads one cached token (16-byte
// vectors); a head's logits go to shared memory, then the same groups read V. With one partition
// the CTA writes the output; otherwise it writes an fp32 partial output with its max logit and
// exp-sum, and paged_attention_reduce_kernel combines the partitions.
//
// Prefill / chunked prefill: grid (num_heads, num_prefill_seqs, ceil(max_query_len / kQueryTile)).
// The queries of a chunk sit at the last q_len positions of the context and attend causally to
// every cached key up to their own position; keys stream through shared memory 32 at a time (one
// per lane) with an online softmax.
//
// Invariant of both: keys at positions >= seq_len (the stale tail of the last block, which may hold
// anything, NaN included) are never loaded.
#pragma once

#include "genq_common.cuh"

namespace genq {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kPartitionSize = 512;
constexpr int kReduceThreads = 128;
constexpr int kPrefillThreads = 128;
constexpr int kPrefillWarps = kPrefillThreads / 32;
constexpr int kPrefillKeys = 32;  // keys per shared-memory tile: one per lane

template <typename T, int HEAD_SIZE>
struct DecodeLayout {
  static constexpr int kVec = DType<T>::kVec;
  static constexpr int kNumVecs = HEAD_SIZE / kVec;
  // Lanes per token: the next power of two >= kNumVecs, at least 8, at most a warp.
  static constexpr int kGroup = kNumVecs > 16 ? 32 : (kNumVecs > 8 ? 16 : 8);
  static constexpr int kVecsPerThread = (kNumVecs + kGroup - 1) / kGroup;
  static constexpr bool kRagged = kNumVecs % kGroup != 0;  // some lanes own no vector
  static constexpr int kGroupsPerWarp = 32 / kGroup;
  static_assert(HEAD_SIZE % kVec == 0, "a head must be whole 16-byte vectors");
};

template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
__global__ void __launch_bounds__(kDecodeThreads, 1) paged_attention_decode_kernel(
    T* __restrict__ out,                // [num_seqs, num_heads, HEAD_SIZE], one partition only
    float* __restrict__ tmp_out,        // [num_seqs, num_heads, max_num_partitions, HEAD_SIZE]
    float* __restrict__ max_logits,     // [num_seqs, num_heads, max_num_partitions]
    float* __restrict__ exp_sums,       // [num_seqs, num_heads, max_num_partitions]
    const T* __restrict__ query,        // [num_seqs, num_heads, HEAD_SIZE], rows q_stride apart
    const T* __restrict__ key_cache,
    const T* __restrict__ value_cache,
    const int* __restrict__ block_tables,  // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens,      // [num_seqs], each >= 1
    int num_kv_heads, int max_blocks_per_seq, int max_num_partitions, int q_stride, float scale,
    int heads_per_cta) {                   // 1, 2 or 4, dividing num_heads / num_kv_heads
  using L = DecodeLayout<T, HEAD_SIZE>;
  static_assert(BLOCK_SIZE % L::kGroupsPerWarp == 0 && kPartitionSize % BLOCK_SIZE == 0,
                "a warp pass covers whole blocks; a partition covers whole blocks");
  const int seq = blockIdx.y;
  const int partition = blockIdx.z;
  const int seq_len = seq_lens[seq];
  const int start_token = partition * kPartitionSize;
  if (start_token >= seq_len) return;  // CTA-uniform: this sequence has fewer partitions
  const int end_token = min_int(start_token + kPartitionSize, seq_len);
  const int start_block = start_token / BLOCK_SIZE;
  const int end_block = (end_token + BLOCK_SIZE - 1) / BLOCK_SIZE;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = lane / L::kGroup;
  const int lane_in_group = lane % L::kGroup;
  const int splits = kDecodeWarps / heads_per_cta;  // warps per query head
  const int head_local = warp / splits;
  const int split = warp % splits;                  // this warp's slice of the partition's blocks
  const int num_heads = gridDim.x * heads_per_cta;
  const int head = blockIdx.x * heads_per_cta + head_local;
  const int kv_head = head / (num_heads / num_kv_heads);  // the same for every warp of the CTA

  __shared__ float logits[kDecodeWarps][kPartitionSize];  // [head_local][token in partition]
  __shared__ float max_scratch[kDecodeWarps];
  __shared__ float sum_scratch[kDecodeWarps];
  __shared__ float partial_out[kDecodeWarps][HEAD_SIZE];

  // This lane's slice of the (scaled) query: vectors lane_in_group, lane_in_group + kGroup, ...
  float q[L::kVecsPerThread][L::kVec];
  const T* q_row = query + static_cast<long long>(seq) * q_stride + head * HEAD_SIZE;
#pragma unroll
  for (int v = 0; v < L::kVecsPerThread; ++v) {
    const int vec = v * L::kGroup + lane_in_group;
    if (!L::kRagged || vec < L::kNumVecs) {
      load_vec(q_row + vec * L::kVec, q[v]);
#pragma unroll
      for (int e = 0; e < L::kVec; ++e) q[v][e] *= scale;
    } else {
#pragma unroll
      for (int e = 0; e < L::kVec; ++e) q[v][e] = 0.f;
    }
  }

  const long long token_stride = static_cast<long long>(num_kv_heads) * HEAD_SIZE;
  const long long block_stride = token_stride * BLOCK_SIZE;
  const int* table = block_tables + static_cast<long long>(seq) * max_blocks_per_seq;
  const T* k_head = key_cache + kv_head * HEAD_SIZE;
  const T* v_head = value_cache + kv_head * HEAD_SIZE;
  float* head_logits = logits[head_local];

  // QK^T: the warps of a head take blocks split, split + splits, ...; group g of a warp takes
  // rows g, g + kGroupsPerWarp, ... of each block.
  float qk_max = neg_inf();
  for (int b = start_block + split; b < end_block; b += splits) {
    const T* k_block = k_head + table[b] * block_stride;
#pragma unroll 4  // 4 rows' loads in flight per lane: ample, and half the code of a full unroll
    for (int i = 0; i < BLOCK_SIZE / L::kGroupsPerWarp; ++i) {
      const int row = i * L::kGroupsPerWarp + group;
      const int token = b * BLOCK_SIZE + row;
      float dot = 0.f;
      if (token < end_token) {
        const T* k = k_block + row * token_stride;
#pragma unroll
        for (int v = 0; v < L::kVecsPerThread; ++v) {
          const int vec = v * L::kGroup + lane_in_group;
          if (!L::kRagged || vec < L::kNumVecs) {
            float kf[L::kVec];
            load_vec(k + vec * L::kVec, kf);
#pragma unroll
            for (int e = 0; e < L::kVec; ++e) dot += q[v][e] * kf[e];
          }
        }
      }
      dot = group_sum<L::kGroup>(dot);  // outside the branch: every lane shuffles
      if (token < end_token) {
        if (lane_in_group == 0) head_logits[token - start_token] = dot;
        qk_max = fmaxf(qk_max, dot);
      }
    }
  }

  // Softmax of each head over the warps that share it.
  qk_max = warp_max(qk_max);
  if (lane == 0) max_scratch[warp] = qk_max;
  __syncthreads();  // logits and per-warp maxima visible
  const int first_warp = head_local * splits;
  float max_logit = max_scratch[first_warp];
  for (int w = first_warp + 1; w < first_warp + splits; ++w) {
    max_logit = fmaxf(max_logit, max_scratch[w]);
  }
  float sum = 0.f;
  for (int i = split * 32 + lane; i < end_token - start_token; i += splits * 32) {
    const float e = expf(head_logits[i] - max_logit);
    head_logits[i] = e;
    sum += e;
  }
  sum = warp_sum(sum);
  if (lane == 0) sum_scratch[warp] = sum;
  __syncthreads();  // exponentials and per-warp sums visible
  float exp_sum = 0.f;
  for (int w = first_warp; w < first_warp + splits; ++w) exp_sum += sum_scratch[w];

  // PV: the same lane groups walk the same rows of V, weighting each by its exponential.
  float acc[L::kVecsPerThread][L::kVec];
#pragma unroll
  for (int v = 0; v < L::kVecsPerThread; ++v) {
#pragma unroll
    for (int e = 0; e < L::kVec; ++e) acc[v][e] = 0.f;
  }
  for (int b = start_block + split; b < end_block; b += splits) {
    const T* v_block = v_head + table[b] * block_stride;
#pragma unroll 4
    for (int i = 0; i < BLOCK_SIZE / L::kGroupsPerWarp; ++i) {
      const int row = i * L::kGroupsPerWarp + group;
      const int token = b * BLOCK_SIZE + row;
      if (token < end_token) {
        const float p = head_logits[token - start_token];
        const T* vp = v_block + row * token_stride;
#pragma unroll
        for (int v = 0; v < L::kVecsPerThread; ++v) {
          const int vec = v * L::kGroup + lane_in_group;
          if (!L::kRagged || vec < L::kNumVecs) {
            float vf[L::kVec];
            load_vec(vp + vec * L::kVec, vf);
#pragma unroll
            for (int e = 0; e < L::kVec; ++e) acc[v][e] += p * vf[e];
          }
        }
      }
    }
  }
  // Sum the groups of the warp (lanes with equal lane_in_group), then the warps of each head.
#pragma unroll
  for (int offset = L::kGroup; offset < 32; offset *= 2) {
#pragma unroll
    for (int v = 0; v < L::kVecsPerThread; ++v) {
#pragma unroll
      for (int e = 0; e < L::kVec; ++e) acc[v][e] += __shfl_xor_sync(kFullMask, acc[v][e], offset);
    }
  }
  if (group == 0) {
#pragma unroll
    for (int v = 0; v < L::kVecsPerThread; ++v) {
      const int vec = v * L::kGroup + lane_in_group;
      if (!L::kRagged || vec < L::kNumVecs) {
#pragma unroll
        for (int e = 0; e < L::kVec; ++e) partial_out[warp][vec * L::kVec + e] = acc[v][e];
      }
    }
  }
  __syncthreads();  // every warp's partial output visible

  for (int idx = threadIdx.x; idx < heads_per_cta * HEAD_SIZE; idx += kDecodeThreads) {
    const int h = idx / HEAD_SIZE;
    const int d = idx % HEAD_SIZE;
    float o = 0.f, s = 0.f;
    for (int w = h * splits; w < (h + 1) * splits; ++w) {
      o += partial_out[w][d];
      s += sum_scratch[w];
    }
    o /= s;
    const long long row_index =
        static_cast<long long>(seq) * num_heads + blockIdx.x * heads_per_cta + h;
    if (max_num_partitions == 1) {
      out[row_index * HEAD_SIZE + d] = DType<T>::from_float(o);
    } else {
      tmp_out[(row_index * max_num_partitions + partition) * HEAD_SIZE + d] = o;
    }
  }
  if (max_num_partitions > 1 && split == 0 && lane == 0) {
    const long long row_index = static_cast<long long>(seq) * num_heads + head;
    max_logits[row_index * max_num_partitions + partition] = max_logit;
    exp_sums[row_index * max_num_partitions + partition] = exp_sum;
  }
}

// Combines the partitions of paged_attention_decode_kernel: grid (num_heads, num_seqs).
template <typename T, int HEAD_SIZE>
__global__ void __launch_bounds__(kReduceThreads, 1) paged_attention_reduce_kernel(
    T* __restrict__ out,                     // [num_seqs, num_heads, HEAD_SIZE]
    const float* __restrict__ tmp_out,       // [num_seqs, num_heads, max_num_partitions, HEAD_SIZE]
    const float* __restrict__ max_logits,    // [num_seqs, num_heads, max_num_partitions]
    const float* __restrict__ exp_sums,      // [num_seqs, num_heads, max_num_partitions]
    const int* __restrict__ seq_lens,        // [num_seqs], each >= 1
    int max_num_partitions) {
  constexpr int kWarps = kReduceThreads / 32;
  __shared__ float max_scratch[kWarps];
  __shared__ float sum_scratch[kWarps];
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int num_partitions = (seq_lens[seq] + kPartitionSize - 1) / kPartitionSize;
  const long long row_index = static_cast<long long>(seq) * gridDim.x + head;
  const float* row_max = max_logits + row_index * max_num_partitions;
  const float* row_sum = exp_sums + row_index * max_num_partitions;

  float m = neg_inf();
  for (int p = threadIdx.x; p < num_partitions; p += kReduceThreads) m = fmaxf(m, row_max[p]);
  const float global_max = block_max<kWarps>(m, max_scratch);
  float s = 0.f;
  for (int p = threadIdx.x; p < num_partitions; p += kReduceThreads) {
    s += row_sum[p] * expf(row_max[p] - global_max);
  }
  const float inv_sum = 1.f / block_sum<kWarps>(s, sum_scratch);

  const float* partial = tmp_out + row_index * max_num_partitions * HEAD_SIZE;
  for (int d = threadIdx.x; d < HEAD_SIZE; d += kReduceThreads) {
    float o = 0.f;
    for (int p = 0; p < num_partitions; ++p) {
      o += partial[p * HEAD_SIZE + d] * row_sum[p] * expf(row_max[p] - global_max);
    }
    out[row_index * HEAD_SIZE + d] = DType<T>::from_float(o * inv_sum);
  }
}

template <int HEAD_SIZE>
struct PrefillLayout {
  static constexpr int kRowsPerWarp = HEAD_SIZE > 128 ? 2 : 4;  // fits 48 KB of static smem
  static constexpr int kQueryTile = kRowsPerWarp * kPrefillWarps;
  static constexpr int kDimsPerLane = (HEAD_SIZE + 31) / 32;
  static constexpr int kPitch = HEAD_SIZE + 1;  // odd pitch: lane-per-key reads hit 32 banks
};

// Loads keys [key0, key0 + kPrefillKeys) of one head into tile as fp32; keys >= num_keys become
// zeros, so a zero weight never meets a stale NaN.
template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
__device__ __forceinline__ void load_key_tile(float (*tile)[PrefillLayout<HEAD_SIZE>::kPitch],
                                              const T* cache_head, const int* table, int key0,
                                              int num_keys, long long token_stride) {
  constexpr int kVec = DType<T>::kVec;
  constexpr int kNumVecs = HEAD_SIZE / kVec;
  for (int idx = threadIdx.x; idx < kPrefillKeys * kNumVecs; idx += kPrefillThreads) {
    const int k = idx / kNumVecs;
    const int vec = idx % kNumVecs;
    const int key = key0 + k;
    float f[kVec];
    if (key < num_keys) {
      const long long slot =
          static_cast<long long>(table[key / BLOCK_SIZE]) * BLOCK_SIZE + key % BLOCK_SIZE;
      load_vec(cache_head + slot * token_stride + vec * kVec, f);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) f[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) tile[k][vec * kVec + e] = f[e];
  }
}

template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
__global__ void __launch_bounds__(kPrefillThreads, 1) paged_attention_prefill_kernel(
    T* __restrict__ out,                       // [num_tokens, num_heads, HEAD_SIZE]
    const T* __restrict__ query,               // [num_tokens, num_heads, HEAD_SIZE], q_stride rows
    const T* __restrict__ key_cache,
    const T* __restrict__ value_cache,
    const int* __restrict__ block_tables,      // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens,          // [num_seqs]
    const int* __restrict__ query_start_loc,   // [num_seqs + 1]
    int seq_offset, int num_kv_heads, int max_blocks_per_seq, int q_stride, float scale) {
  using L = PrefillLayout<HEAD_SIZE>;
  constexpr int kVec = DType<T>::kVec;
  constexpr int kNumVecs = HEAD_SIZE / kVec;
  constexpr int R = L::kRowsPerWarp;
  const int head = blockIdx.x;
  const int seq = seq_offset + blockIdx.y;
  const int num_heads = gridDim.x;
  const int q_begin = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_begin;
  const int tile_begin = blockIdx.z * L::kQueryTile;
  if (tile_begin >= q_len) return;  // CTA-uniform: a shorter chunk than the longest one
  const int rows = min_int(L::kQueryTile, q_len - tile_begin);
  const int first_pos = seq_lens[seq] - q_len + tile_begin;  // position of this tile's row 0
  const int num_keys = first_pos + rows;                      // keys 0 .. last row's position
  const int kv_head = head / (num_heads / num_kv_heads);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  __shared__ float q_tile[L::kQueryTile][HEAD_SIZE];
  __shared__ float kv_tile[kPrefillKeys][L::kPitch];
  __shared__ float p_tile[kPrefillWarps][R][kPrefillKeys];  // a warp's weights, broadcast in PV

  for (int idx = threadIdx.x; idx < L::kQueryTile * kNumVecs; idx += kPrefillThreads) {
    const int r = idx / kNumVecs;
    const int vec = idx % kNumVecs;
    float f[kVec];
    if (r < rows) {
      load_vec(query + static_cast<long long>(q_begin + tile_begin + r) * q_stride +
                   head * HEAD_SIZE + vec * kVec,
               f);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) f[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) q_tile[r][vec * kVec + e] = f[e] * scale;
  }

  const long long token_stride = static_cast<long long>(num_kv_heads) * HEAD_SIZE;
  const int* table = block_tables + static_cast<long long>(seq) * max_blocks_per_seq;
  const T* k_head = key_cache + kv_head * HEAD_SIZE;
  const T* v_head = value_cache + kv_head * HEAD_SIZE;

  float m[R], l[R], acc[R][L::kDimsPerLane];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = neg_inf();
    l[r] = 0.f;
#pragma unroll
    for (int j = 0; j < L::kDimsPerLane; ++j) acc[r][j] = 0.f;
  }

  for (int key0 = 0; key0 < num_keys; key0 += kPrefillKeys) {
    load_key_tile<T, HEAD_SIZE, BLOCK_SIZE>(kv_tile, k_head, table, key0, num_keys, token_stride);
    __syncthreads();  // K tile (and the Q tile) loaded

    const int key = key0 + lane;
    float s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = 0.f;
    for (int d = 0; d < HEAD_SIZE; ++d) {
      const float kd = kv_tile[lane][d];
#pragma unroll
      for (int r = 0; r < R; ++r) s[r] += q_tile[warp * R + r][d] * kd;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = warp * R + r;
      const bool visible = row < rows && key <= first_pos + row;  // causal
      const float logit = visible ? s[r] : neg_inf();
      const float m_new = fmaxf(m[r], warp_max(logit));
      // m_new stays -inf only for padding rows, which see no key at all.
      const float alpha = m_new == neg_inf() ? 1.f : expf(m[r] - m_new);
      const float p = visible ? expf(logit - m_new) : 0.f;
      p_tile[warp][r][lane] = p;
      l[r] = l[r] * alpha + warp_sum(p);
#pragma unroll
      for (int j = 0; j < L::kDimsPerLane; ++j) acc[r][j] *= alpha;
      m[r] = m_new;
    }
    __syncthreads();  // K tile fully read before V overwrites it

    load_key_tile<T, HEAD_SIZE, BLOCK_SIZE>(kv_tile, v_head, table, key0, num_keys, token_stride);
    __syncthreads();  // V tile loaded

    for (int k = 0; k < kPrefillKeys; ++k) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float pk = p_tile[warp][r][k];
#pragma unroll
        for (int j = 0; j < L::kDimsPerLane; ++j) {
          const int d = lane + 32 * j;
          if (HEAD_SIZE % 32 == 0 || d < HEAD_SIZE) acc[r][j] += pk * kv_tile[k][d];
        }
      }
    }
    __syncthreads();  // V tile fully read before the next K tile overwrites it
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = warp * R + r;
    if (row < rows) {
      const float inv_sum = 1.f / l[r];
      T* o = out + (static_cast<long long>(q_begin + tile_begin + row) * num_heads + head) *
                       HEAD_SIZE;
#pragma unroll
      for (int j = 0; j < L::kDimsPerLane; ++j) {
        const int d = lane + 32 * j;
        if (HEAD_SIZE % 32 == 0 || d < HEAD_SIZE) o[d] = DType<T>::from_float(acc[r][j] * inv_sum);
      }
    }
  }
}

}  // namespace genq
