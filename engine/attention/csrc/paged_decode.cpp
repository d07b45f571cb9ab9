// Paged decode attention for the CPU: one query token per sequence, K/V read in place through
// the block table (no gather, no padding), GQA. float32.
//
// Cache layout (engine/attention/base.py): [num_blocks, block_size, num_kv_heads, head_size].
// One pass over the sequence, one cache block at a time (online softmax: a running max and sum
// per query head, the accumulator rescaled once per block). A block's K rows for all KV heads
// are contiguous, so a work item that covers every KV head of a sequence streams memory in
// order. Work items are (sequence, range of KV heads), shared by `num_threads` threads: torch's
// OpenMP pool when built with -fopenmp, std::threads otherwise.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int kLanes = 8;
constexpr int kMaxGroup = 32;
constexpr int kMaxHead = 256;

// Reductions keep kLanes partial results so they vectorize without -ffast-math (and stay
// deterministic: the same order on every run).
inline float lane_sum(const float* lanes) {
  float s = 0;
  for (int j = 0; j < kLanes; ++j) s += lanes[j];
  return s;
}

inline float dot(const float* a, const float* b, int n) {
  float lanes[kLanes] = {0};
  for (int d = 0; d < n; d += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] += a[d + j] * b[d + j];
  return lane_sum(lanes);
}

// Max and sum over s[0, n); s has room for a multiple of kLanes (padding is overwritten).
inline float max_of(float* s, int n, int padded) {
  for (int t = n; t < padded; ++t) s[t] = -INFINITY;
  float lanes[kLanes];
  for (int j = 0; j < kLanes; ++j) lanes[j] = -INFINITY;
  for (int t = 0; t < padded; t += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] = std::max(lanes[j], s[t + j]);
  float m = lanes[0];
  for (int j = 1; j < kLanes; ++j) m = std::max(m, lanes[j]);
  return m;
}

inline float sum_of(const float* s, int padded) {
  float lanes[kLanes] = {0};
  for (int t = 0; t < padded; t += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] += s[t + j];
  return lane_sum(lanes);
}

// exp(x) for x <= 0, within 2 ulp (Cephes' expf polynomial, range reduction by ln 2), written
// as straight-line code over an array so the compiler vectorizes it. exp(-inf) == 0.
inline void exp_inplace(float* x, int n) {
  for (int i = 0; i < n; ++i) {
    const float v = std::max(x[i], -87.3f);
    // Round to nearest by the 1.5 * 2^23 trick (exact without -ffast-math, and vectorizes).
    const float k = (v * 1.44269504088896341f + 12582912.f) - 12582912.f;
    const float r = v - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    x[i] = x[i] < -87.3f ? 0.0f : p * scale;
  }
}

struct Args {
  const float* q;
  const float* k_cache;
  const float* v_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  float* out;
  int num_heads, num_kv_heads, head_size, block_size, table_width;
  float scale;
};

struct Scratch {
  std::vector<float> scores, acc, max, sum;
};

// Sequence `b`, KV heads [kh0, kh1): all their query heads in one pass over the blocks.
void attend(const Args& a, int b, int kh0, int kh1, Scratch& w) {
  const int group = a.num_heads / a.num_kv_heads;
  const int d = a.head_size;
  const int bs = a.block_size;
  const int heads = (kh1 - kh0) * group;  // query heads handled here
  const int len = a.seq_lens[b];
  const int32_t* table = a.block_tables + static_cast<int64_t>(b) * a.table_width;
  const float* q = a.q + (static_cast<int64_t>(b) * a.num_heads + kh0 * group) * d;
  const int64_t row = static_cast<int64_t>(a.num_kv_heads) * d;  // floats per cache slot
  const int stride = (bs + kLanes - 1) / kLanes * kLanes;  // scores per head, padded
  w.scores.resize(static_cast<size_t>(heads) * stride);
  w.acc.assign(static_cast<size_t>(heads) * d, 0.f);
  w.max.assign(heads, -INFINITY);
  w.sum.assign(heads, 0.f);
  for (int start = 0; start < len; start += bs) {
    const int n = std::min(bs, len - start);
    const int padded = (n + kLanes - 1) / kLanes * kLanes;
    const int64_t base = static_cast<int64_t>(table[start / bs]) * bs * row;
    const float* kb = a.k_cache + base;
    const float* vb = a.v_cache + base;
    for (int t = 0; t < n; ++t)
      for (int kh = kh0; kh < kh1; ++kh) {
        const float* k = kb + t * row + kh * d;
        for (int g = 0; g < group; ++g) {
          const int h = (kh - kh0) * group + g;
          w.scores[static_cast<size_t>(h) * stride + t] = dot(q + h * d, k, d) * a.scale;
        }
      }
    for (int h = 0; h < heads; ++h) {
      float* s = w.scores.data() + static_cast<size_t>(h) * stride;
      const float m = std::max(w.max[h], max_of(s, n, padded));
      float alpha = w.max[h] - m;  // -inf on the first block: the accumulator is zero anyway
      exp_inplace(&alpha, 1);
      for (int t = 0; t < padded; ++t) s[t] -= m;
      exp_inplace(s, padded);  // padding: exp(-inf) == 0
      w.sum[h] = w.sum[h] * alpha + sum_of(s, padded);
      w.max[h] = m;
      float* o = w.acc.data() + static_cast<size_t>(h) * d;
      for (int i = 0; i < d; ++i) o[i] *= alpha;
    }
    for (int t = 0; t < n; ++t)
      for (int kh = kh0; kh < kh1; ++kh) {
        const float* v = vb + t * row + kh * d;
        for (int g = 0; g < group; ++g) {
          const int h = (kh - kh0) * group + g;
          const float p = w.scores[static_cast<size_t>(h) * stride + t];
          float* o = w.acc.data() + static_cast<size_t>(h) * d;
          for (int i = 0; i < d; ++i) o[i] += p * v[i];
        }
      }
  }
  float* out = a.out + (static_cast<int64_t>(b) * a.num_heads + kh0 * group) * d;
  for (int h = 0; h < heads; ++h) {
    const float inv = 1.f / w.sum[h];
    for (int i = 0; i < d; ++i) out[h * d + i] = w.acc[static_cast<size_t>(h) * d + i] * inv;
  }
}

}  // namespace

extern "C" int genq_paged_decode_f32(const float* q, const float* k_cache, const float* v_cache,
                                     const int32_t* block_tables, const int32_t* seq_lens,
                                     float* out, int num_seqs, int num_heads, int num_kv_heads,
                                     int head_size, int block_size, int table_width, float scale,
                                     int num_threads) {
  if (num_heads % num_kv_heads || num_heads / num_kv_heads > kMaxGroup ||
      head_size % kLanes || head_size > kMaxHead)
    return 1;
  const Args a{q, k_cache, v_cache, block_tables, seq_lens, out, num_heads, num_kv_heads,
               head_size, block_size, table_width, scale};
  // Whole sequences per item when there are enough of them to keep every thread busy;
  // otherwise one KV head per item.
  const int split = num_seqs >= 4 * num_threads ? 1 : num_kv_heads;
  const int per_item = num_kv_heads / split;
  const int items = num_seqs * split;
#ifdef _OPENMP
  // torch's own OpenMP runtime (libgomp.so.1 is already loaded by torch, and the loader reuses
  // it): its worker threads, which spin for a while after every torch op, do this work instead
  // of competing with threads of our own for the same cores.
#pragma omp parallel num_threads(num_threads)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < items; ++i) {
      const int kh0 = (i % split) * per_item;
      attend(a, i / split, kh0, kh0 + per_item, scratch);
    }
  }
#else
  std::atomic<int> next{0};
  auto work = [&] {
    Scratch scratch;
    for (int i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
      const int kh0 = (i % split) * per_item;
      attend(a, i / split, kh0, kh0 + per_item, scratch);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < num_threads && t < items; ++t) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
#endif
  return 0;
}
