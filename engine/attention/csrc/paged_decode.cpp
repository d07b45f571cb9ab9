// Paged decode attention for the CPU: one query token per sequence, K/V read in place through
// the block table (no gather, no padding), online softmax, GQA. float32.
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

void attend(const Args& a, int b, int kh) {
  const int group = a.num_heads / a.num_kv_heads;
  const int d = a.head_size;
  const int len = a.seq_lens[b];
  const int32_t* table = a.block_tables + static_cast<int64_t>(b) * a.table_width;
  const float* q = a.q + (static_cast<int64_t>(b) * a.num_heads + kh * group) * d;
  float m[kMaxGroup], l[kMaxGroup];
  alignas(64) float acc[kMaxGroup * kMaxHead];
  for (int g = 0; g < group; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  for (int i = 0; i < group * d; ++i) acc[i] = 0.f;
  for (int t = 0; t < len; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / a.block_size]) * a.block_size +
                         t % a.block_size;
    const int64_t off = (slot * a.num_kv_heads + kh) * d;
    const float* k = a.k_cache + off;
    const float* v = a.v_cache + off;
    for (int g = 0; g < group; ++g) {
      const float s = dot(q + g * d, k, d) * a.scale;
      float* o = acc + g * d;
      if (s > m[g]) {
        const float c = std::exp(m[g] - s);
        l[g] = l[g] * c + 1.f;
        for (int i = 0; i < d; ++i) o[i] = o[i] * c + v[i];
        m[g] = s;
      } else {
        const float p = std::exp(s - m[g]);
        l[g] += p;
        for (int i = 0; i < d; ++i) o[i] += p * v[i];
      }
    }
  }
  float* out = a.out + (static_cast<int64_t>(b) * a.num_heads + kh * group) * d;
  for (int g = 0; g < group; ++g) {
    const float inv = 1.f / l[g];
    for (int i = 0; i < d; ++i) out[g * d + i] = acc[g * d + i] * inv;
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
  const int items = num_seqs * num_kv_heads;
  std::atomic<int> next{0};
  auto work = [&] {
    for (int i = next.fetch_add(1); i < items; i = next.fetch_add(1))
      attend(a, i / num_kv_heads, i % num_kv_heads);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < num_threads && t < items; ++t) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  return 0;
}
