// Paged decode attention for the CPU: one query token per sequence, K/V read in place through
// the block table (no gather, no padding), GQA. float32.
//
// Cache layout (engine/attention/base.py): [num_blocks, block_size, num_kv_heads, head_size].
// One KV head at a time, with all its query heads (the group): the scores of up to kChunk tokens
// are held at once, so a sequence no longer than that gets an exact two-pass softmax, and a
// longer one an online softmax rescaled once per chunk, and only when the maximum grew. Scores
// are computed 8 tokens at a time (8 dot products reduced together, one vector out); the head
// size and group size are template parameters for the common shapes, so every inner loop has a
// compile-time trip count, and all scratch lives on the stack with fixed sizes. Work items are
// (sequence, range of KV heads), shared by `num_threads` threads: torch's OpenMP pool when built
// with -fopenmp, std::threads otherwise. Every result is computed in the same order whatever the
// thread count or the split, so results are deterministic.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

// GCC/Clang vector extensions: plain SIMD on any target, without -ffast-math.
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

constexpr int kLanes = 8;
constexpr int kMaxGroup = 32;
constexpr int kMaxHead = 256;
constexpr int kMaxVecs = kMaxHead / kLanes;
constexpr int kChunk = 256;  // tokens whose scores are held at once (a multiple of kLanes)
constexpr int kTile = 16;    // tokens per pass of the V accumulation for large groups

// Stands in for the K rows past the end of a sequence in its last 8-token tile: the tail
// slots of the cache block may hold stale (even NaN) values and are never read.
alignas(64) const float kZeroRow[kMaxHead] = {};

inline v8 load(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

inline v8 vmax(v8 a, v8 b) { return a > b ? a : b; }

// Lane i of the result: the sum of the 8 lanes of a[i], in a fixed order.
inline v8 reduce8(const v8* a) {
  auto pair = [](v8 x, v8 y) {  // [x01 x23 y01 y23 | x45 x67 y45 y67]
    return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  const v8 lo = pair(pair(a[0], a[1]), pair(a[2], a[3]));  // [a0..a3 low half | high half]
  const v8 hi = pair(pair(a[4], a[5]), pair(a[6], a[7]));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

inline float lane_sum(v8 x) {
  float s = 0;
  for (int j = 0; j < kLanes; ++j) s += x[j];
  return s;
}

inline float lane_max(v8 x) {
  float m = x[0];
  for (int j = 1; j < kLanes; ++j) m = std::max(m, x[j]);
  return m;
}

// exp(x) for x <= 0, within 2 ulp (Cephes' expf polynomial, range reduction by ln 2).
// exp(-inf) == 0.
inline v8 exp_le0(v8 x) {
  const v8 lo = splat(-87.3f);
  const v8 v = x < lo ? lo : x;
  // Round to nearest by the 1.5 * 2^23 trick (exact without -ffast-math).
  const v8 k = (v * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const v8 r = v - k * 0.693359375f + k * 2.12194440e-4f;
  v8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const v8i bits = (__builtin_convertvector(k, v8i) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < lo ? splat(0.f) : p * scale;
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

// Scratch and running softmax state of one KV head's query heads: NV vectors per head and G
// heads per group when nonzero (compile-time sizes, loops unrolled), else sized for the largest.
template <int NV, int G>
struct Group {
  static constexpr int kNv = NV ? NV : kMaxVecs;
  static constexpr int kG = G ? G : kMaxGroup;
  alignas(64) float scores[kG][kChunk];  // of the current chunk; then exp(score - max)
  const float* rows[kChunk];  // the K row of each token of the chunk (V: the same offset)
  v8 acc[kG][kNv];
  float max[kG], sum[kG];
};

// scores[g][t] = q[g] . k[t] * scale for the chunk's tokens, 8 tokens per reduction; the last
// tile's missing tokens read kZeroRow and score -inf.
template <int NV, int G>
void score_chunk(Group<NV, G>& w, const float* q, int nv, int group, int n, float scale) {
  const int d = nv * kLanes;
  const int padded = (n + kLanes - 1) / kLanes * kLanes;
  for (int t = n; t < padded; ++t) w.rows[t] = kZeroRow;
  for (int t0 = 0; t0 < padded; t0 += kLanes)
    for (int g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      v8 dots[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        const float* k = w.rows[t0 + i];
        v8 s = load(qg) * load(k);
        for (int j = 1; j < nv; ++j) s += load(qg + j * kLanes) * load(k + j * kLanes);
        dots[i] = s;
      }
      store(&w.scores[g][t0], reduce8(dots) * scale);
    }
  for (int g = 0; g < group; ++g)
    for (int t = n; t < padded; ++t) w.scores[g][t] = -INFINITY;  // exp gives 0
}

// Online softmax over chunks: scores become exp(score - running max); the sums and
// accumulators of earlier chunks are rescaled only when the maximum grew.
template <int NV, int G>
void softmax_chunk(Group<NV, G>& w, int nv, int group, int n) {
  const int padded = (n + kLanes - 1) / kLanes * kLanes;
  for (int g = 0; g < group; ++g) {
    float* s = w.scores[g];
    v8 m = splat(-INFINITY);
    for (int t = 0; t < padded; t += kLanes) m = vmax(m, load(s + t));
    const float chunk_max = lane_max(m);
    if (chunk_max > w.max[g]) {
      if (w.max[g] != -INFINITY) {
        const float alpha = exp_le0(splat(w.max[g] - chunk_max))[0];
        w.sum[g] *= alpha;
        for (int j = 0; j < nv; ++j) w.acc[g][j] *= alpha;
      }
      w.max[g] = chunk_max;
    }
    const v8 mg = splat(w.max[g]);
    v8 total = splat(0.f);
    for (int t = 0; t < padded; t += kLanes) {
      const v8 e = exp_le0(load(s + t) - mg);
      store(s + t, e);
      total += e;
    }
    w.sum[g] += lane_sum(total);
  }
}

// acc[g] += sum over the chunk's tokens of p[g][t] * v[t]. Two or more partial sums per output
// vector (tokens t, t+1, ... in turn) keep about 8 independent FMA chains in flight; they are
// added in a fixed order, so the result does not depend on anything but the inputs.
template <int NV, int G>
void accumulate_chunk(Group<NV, G>& w, const Args& a, int nv, int group, int n) {
  if constexpr (G != 0 && G * NV <= 8) {  // the whole group's accumulators fit in registers
    v8 o[2][G][NV];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < NV; ++j) o[0][g][j] = w.acc[g][j], o[1][g][j] = splat(0.f);
    auto add = [&](v8 (&o)[G][NV], int t) {
      const float* v = a.v_cache + (w.rows[t] - a.k_cache);
      v8 x[NV];
      for (int j = 0; j < NV; ++j) x[j] = load(v + j * kLanes);
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < NV; ++j) o[g][j] += w.scores[g][t] * x[j];
    };
    int t = 0;
    for (; t + 2 <= n; t += 2) add(o[0], t), add(o[1], t + 1);
    if (t < n) add(o[0], t);
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < NV; ++j) w.acc[g][j] = o[0][g][j] + o[1][g][j];
  } else {  // one query head at a time over tiles of kTile tokens (their V rows stay in L1)
    constexpr int kParts = NV ? std::max(2, 8 / NV) : 2;
    for (int t0 = 0; t0 < n; t0 += kTile) {
      const int t1 = std::min(n, t0 + kTile);
      for (int g = 0; g < group; ++g) {
        const float* p = w.scores[g];
        v8 o[kParts][Group<NV, G>::kNv];
        for (int j = 0; j < nv; ++j) {
          o[0][j] = w.acc[g][j];
          for (int u = 1; u < kParts; ++u) o[u][j] = splat(0.f);
        }
        auto add = [&](v8* o, int t) {
          const float* v = a.v_cache + (w.rows[t] - a.k_cache);
          for (int j = 0; j < nv; ++j) o[j] += p[t] * load(v + j * kLanes);
        };
        int t = t0;
        for (; t + kParts <= t1; t += kParts)
          for (int u = 0; u < kParts; ++u) add(o[u], t + u);
        for (; t < t1; ++t) add(o[0], t);
        for (int j = 0; j < nv; ++j) {
          v8 x = o[0][j];
          for (int u = 1; u < kParts; ++u) x += o[u][j];
          w.acc[g][j] = x;
        }
      }
    }
  }
}

// Sequence `b`, KV heads [kh0, kh1), each with all its query heads, one chunk of up to kChunk
// tokens at a time.
template <int NV, int G>
void attend(const Args& a, int b, int kh0, int kh1) {
  const int nv = NV ? NV : a.head_size / kLanes;
  const int group = G ? G : a.num_heads / a.num_kv_heads;
  const int d = nv * kLanes;
  const int bs = a.block_size;
  const int len = a.seq_lens[b];
  const int32_t* table = a.block_tables + static_cast<int64_t>(b) * a.table_width;
  const int64_t row = static_cast<int64_t>(a.num_kv_heads) * d;  // floats per cache slot
  Group<NV, G> w;
  for (int kh = kh0; kh < kh1; ++kh) {
    const float* q = a.q + (static_cast<int64_t>(b) * a.num_heads + kh * group) * d;
    for (int g = 0; g < group; ++g) {
      for (int j = 0; j < nv; ++j) w.acc[g][j] = splat(0.f);
      w.max[g] = -INFINITY;
      w.sum[g] = 0.f;
    }
    for (int start = 0; start < len; start += kChunk) {
      const int n = std::min(kChunk, len - start);
      for (int t = 0, blk = start / bs, slot = start % bs; t < n; ++blk, slot = 0) {
        const float* k = a.k_cache + (static_cast<int64_t>(table[blk]) * bs + slot) * row + kh * d;
        for (const int end = std::min(n, t + bs - slot); t < end; ++t, k += row) w.rows[t] = k;
      }
      score_chunk(w, q, nv, group, n, a.scale);
      softmax_chunk(w, nv, group, n);
      accumulate_chunk(w, a, nv, group, n);
    }
    float* out = a.out + (static_cast<int64_t>(b) * a.num_heads + kh * group) * d;
    for (int g = 0; g < group; ++g) {
      const float inv = 1.f / w.sum[g];
      for (int j = 0; j < nv; ++j) store(out + g * d + j * kLanes, w.acc[g][j] * inv);
    }
  }
}

using Kernel = void (*)(const Args&, int, int, int);

template <int NV>
Kernel for_group(int group) {
  switch (group) {
    case 1: return attend<NV, 1>;
    case 2: return attend<NV, 2>;
    case 4: return attend<NV, 4>;
    case 8: return attend<NV, 8>;
    default: return attend<NV, 0>;
  }
}

Kernel kernel_for(int head_size, int group) {
  switch (head_size) {
    case 16: return for_group<2>(group);
    case 32: return for_group<4>(group);
    case 64: return for_group<8>(group);
    case 128: return for_group<16>(group);
    case 256: return for_group<32>(group);
    default: return attend<0, 0>;
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
  const Kernel attend_items = kernel_for(head_size, num_heads / num_kv_heads);
  // Whole sequences per item when there are enough of them to keep every thread busy;
  // otherwise one KV head per item.
  const int split = num_seqs >= 4 * num_threads ? 1 : num_kv_heads;
  const int per_item = num_kv_heads / split;
  const int items = num_seqs * split;
  auto run = [&](int i) {
    const int kh0 = (i % split) * per_item;
    attend_items(a, i / split, kh0, kh0 + per_item);
  };
  if (num_threads <= 1) {
    for (int i = 0; i < items; ++i) run(i);
    return 0;
  }
#ifdef _OPENMP
  // torch's own OpenMP runtime (libgomp.so.1 is already loaded by torch, and the loader reuses
  // it): its worker threads, which spin for a while after every torch op, do this work instead
  // of competing with threads of our own for the same cores.
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
  for (int i = 0; i < items; ++i) run(i);
#else
  std::atomic<int> next{0};
  auto work = [&] {
    for (int i = next.fetch_add(1); i < items; i = next.fetch_add(1)) run(i);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < num_threads && t < items; ++t) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
#endif
  return 0;
}
