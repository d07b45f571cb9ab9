// Paged decode attention for the CPU: one query token per sequence, K/V read in place through
// the block table (no gather, no padding), GQA. float32.
//
// Cache layout (engine/attention/base.py): [num_blocks, block_size, num_kv_heads, head_size].
// Work items are (sequence, kv head) pairs, shared by `num_threads` std::threads.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

namespace {

constexpr int kLanes = 8;
constexpr int kMaxGroup = 32;
constexpr int kMaxHead = 256;

inline float dot(const float* a, const float* b, int n) {
  float lanes[kLanes] = {0};
  for (int d = 0; d < n; d += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] += a[d + j] * b[d + j];
  float s = 0;
  for (int j = 0; j < kLanes; ++j) s += lanes[j];
  return s;
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

void attend(const Args& a, int b, int kh, std::vector<float>& scores) {
  // Two passes per (sequence, kv head): scores for every token and query head of the group,
  // then softmax and the weighted sum of V. No per-token rescaling, no branches.
  const int group = a.num_heads / a.num_kv_heads;
  const int d = a.head_size;
  const int len = a.seq_lens[b];
  const int32_t* table = a.block_tables + static_cast<int64_t>(b) * a.table_width;
  const float* q = a.q + (static_cast<int64_t>(b) * a.num_heads + kh * group) * d;
  scores.resize(static_cast<size_t>(group) * len);
  float m[kMaxGroup];
  for (int g = 0; g < group; ++g) m[g] = -INFINITY;
  for (int t = 0; t < len; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / a.block_size]) * a.block_size +
                         t % a.block_size;
    const float* k = a.k_cache + (slot * a.num_kv_heads + kh) * d;
    for (int g = 0; g < group; ++g) {
      const float s = dot(q + g * d, k, d) * a.scale;
      scores[static_cast<size_t>(g) * len + t] = s;
      m[g] = s > m[g] ? s : m[g];
    }
  }
  float inv[kMaxGroup];
  for (int g = 0; g < group; ++g) {
    float* row = scores.data() + static_cast<size_t>(g) * len;
    float sum = 0.f;
    for (int t = 0; t < len; ++t) {
      row[t] = std::exp(row[t] - m[g]);
      sum += row[t];
    }
    inv[g] = 1.f / sum;
  }
  alignas(64) float acc[kMaxGroup * kMaxHead];
  for (int i = 0; i < group * d; ++i) acc[i] = 0.f;
  for (int t = 0; t < len; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / a.block_size]) * a.block_size +
                         t % a.block_size;
    const float* v = a.v_cache + (slot * a.num_kv_heads + kh) * d;
    for (int g = 0; g < group; ++g) {
      const float p = scores[static_cast<size_t>(g) * len + t];
      float* o = acc + g * d;
      for (int i = 0; i < d; ++i) o[i] += p * v[i];
    }
  }
  float* out = a.out + (static_cast<int64_t>(b) * a.num_heads + kh * group) * d;
  for (int g = 0; g < group; ++g)
    for (int i = 0; i < d; ++i) out[g * d + i] = acc[g * d + i] * inv[g];
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
  const int items = num_seqs * num_kv_heads;
  std::atomic<int> next{0};
  auto work = [&] {
    std::vector<float> scores;
    for (int i = next.fetch_add(1); i < items; i = next.fetch_add(1))
      attend(a, i / num_kv_heads, i % num_kv_heads, scores);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < num_threads && t < items; ++t) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  return 0;
}
