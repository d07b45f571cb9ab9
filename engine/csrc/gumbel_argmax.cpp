// The Gumbel-max draw on the CPU: argmax over a row's tokens of logit + noise, with the noise
// of engine/noise.py, without making the whole noise exactly.
//
// The noise of (row key k, token t) is g = float(-log(-log((h + 0.5) / 2^32))), h the 32-bit
// hash fmix32(token_hash[t] ^ k), the logs in double. The draw is the first maximum of the
// float32 sums logit + g (as torch adds and numpy's argmax picks). Two double logs per token
// are most of a step's sampling; instead:
//   1. every token gets a float32 estimate of its sum whose error is at most kNoiseError plus
//      the rounding of one float addition (the estimate's logs are short series, see below);
//   2. only the tokens whose estimate is within twice that of the row's largest estimate can
//      hold the maximum: their exact sums (glibc's log in double, rounded as the reference is)
//      decide, the first maximum in token order winning.
// A row holding NaN picks its first NaN, else one holding +inf its first +inf, else a row of
// -inf only picks token 0: what argmax over the exact sums picks.
//
// Rows are independent: with OpenMP they are shared by `num_threads` threads, and the result is
// the same whatever the split.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// Multiply-adds may fuse (the estimate only; the exact sums have no product to fuse).
#pragma GCC optimize("fp-contract=fast")

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

constexpr int kLanes = 8;
// The estimate's noise is within 2e-6 of the exact noise over all 2^32 hashes (checked
// exhaustively once; tests/engine/test_gumbel_argmax.py checks a sample); the bound used is 50x
// that.
constexpr float kNoiseError = 1e-4f;

inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

// murmur3's finaliser, on one hash (uint32_t) or eight (v8u).
template <typename U>
inline U fmix32(U h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// 2 atanh(s) = log((1 + s) / (1 - s)) for |s| <= 1/3, within 3e-9 (the series to s^17).
inline v8 two_atanh(v8 s) {
  const v8 s2 = s * s;
  v8 p = splat(2.f / 17);
  for (float c : {2.f / 15, 2.f / 13, 2.f / 11, 2.f / 9, 2.f / 7, 2.f / 5, 2.f / 3, 2.f})
    p = p * s2 + c;
  return s * p;
}

// 2 atanh(s) for |s| <= 0.172, within 3e-9 (the series to s^11).
inline v8 two_atanh_short(v8 s) {
  const v8 s2 = s * s;
  v8 p = splat(2.f / 11);
  for (float c : {2.f / 9, 2.f / 7, 2.f / 5, 2.f / 3, 2.f}) p = p * s2 + c;
  return s * p;
}

// x = m * 2^e with m in [sqrt(1/2), sqrt(2)), for positive normal x (the exponent as a float).
inline v8 split_exponent(v8 x, v8* m) {
  v8i bits;
  std::memcpy(&bits, &x, sizeof bits);
  v8i e = ((bits >> 23) & 0xFF) - 127;
  v8i mbits = (bits & 0x7FFFFF) | 0x3F800000;  // m in [1, 2)
  const v8i big = mbits > 0x3FB504F3;          // m > sqrt(2): halve it
  mbits -= big & 0x00800000;
  e -= big;  // (true is -1)
  std::memcpy(m, &mbits, sizeof *m);
  return __builtin_convertvector(e, v8);
}

constexpr float kLn2 = 0.693147180559945f;

// The estimate of -log(-log(u)), u = (h + 0.5) / 2^32, in two logs of the form
// e log 2 + 2 atanh(s). The inner one, a = -log(u):
//   u < 1/2: u = m 2^e, a = -(e log 2 + 2 atanh((m - 1) / (m + 1)));
//   u >= 1/2: a = -log(1 - x) = 2 atanh(x / (2 - x)), x = (2^32 - 1 - h + 0.5) / 2^32, held
//   apart from u, which would lose what matters when it is close to 1.
// Each branch converts a value below 2^31 (signed conversions are one instruction); the lanes
// of the other branch compute garbage that the selects drop.
inline v8 noise_estimate(v8u h) {
  const v8i upper = __builtin_convertvector(h >> 31, v8i) != 0;
  const v8 u = (__builtin_convertvector(v8i(h), v8) + 0.5f) * 0x1p-32f;
  const v8 x = (__builtin_convertvector(v8i(~h), v8) + 0.5f) * 0x1p-32f;
  v8 m;
  const v8 e = split_exponent(u, &m);
  const v8 num = upper ? x : m - 1.f;
  const v8 den = upper ? 2.f - x : m + 1.f;
  const v8 inner = (upper ? splat(0.f) : e) * kLn2 + two_atanh(num / den);
  const v8 a = upper ? inner : -inner;
  const v8 e2 = split_exponent(a, &m);
  return -(e2 * kLn2 + two_atanh_short((m - 1.f) / (m + 1.f)));
}

inline float noise_exact(uint32_t h) {
  return static_cast<float>(-std::log(-std::log((static_cast<double>(h) + 0.5) / 4294967296.0)));
}

int64_t draw_row(const float* logits, int vocab, const uint32_t* token_hash, uint32_t key,
                 float* estimate) {
  const int whole = vocab / kLanes * kLanes;
  const v8u k = v8u{key, key, key, key, key, key, key, key};
  float top = -INFINITY;
  bool unusual = false;  // NaN or +inf among the logits
  for (int t = 0; t < whole; t += kLanes) {
    v8u th;
    std::memcpy(&th, token_hash + t, sizeof th);
    v8 l;
    std::memcpy(&l, logits + t, sizeof l);
    const v8 s = l + noise_estimate(fmix32(th ^ k));
    std::memcpy(estimate + t, &s, sizeof s);
    for (int j = 0; j < kLanes; ++j) {
      top = s[j] > top ? s[j] : top;
      unusual |= !(l[j] < INFINITY);
    }
  }
  for (int t = whole; t < vocab; ++t) {
    // The tail one token at a time, through the same vector code.
    v8u th = {token_hash[t]};
    const v8 s = logits[t] + noise_estimate(fmix32(th ^ k));
    estimate[t] = s[0];
    top = s[0] > top ? s[0] : top;
    unusual |= !(logits[t] < INFINITY);
  }
  if (unusual) {
    for (int t = 0; t < vocab; ++t)
      if (std::isnan(logits[t])) return t;
    for (int t = 0; t < vocab; ++t)
      if (logits[t] == INFINITY) return t;
  }
  if (top == -INFINITY) return 0;  // every logit -inf
  // An estimate is within kNoiseError and two roundings of its exact sum. The maximum's exact
  // sum is within that of `top`, so its estimate is within twice that of `top`; a rounding is
  // at most |sum| * 2^-24, and the sums that matter are within 1 of |top|.
  const float slack = 2 * kNoiseError + 4 * (std::fabs(top) + 1) * 0x1p-23f;
  const float floor = top - slack;
  int64_t best = -1;
  float best_sum = -INFINITY;
  for (int t = 0; t < vocab; ++t) {
    if (estimate[t] < floor) continue;
    const float sum = logits[t] + noise_exact(fmix32(token_hash[t] ^ key));
    if (best < 0 || sum > best_sum) {
      best = t;
      best_sum = sum;
    }
  }
  return best;
}

}  // namespace

// logits [rows, vocab] float32 (row-major, contiguous), keys [rows], token_hash [vocab]; writes
// the drawn token of each row to out [rows].
extern "C" void genq_gumbel_argmax(const float* logits, int rows, int vocab,
                                   const uint32_t* token_hash, const uint32_t* keys,
                                   int64_t* out, int num_threads) {
#ifdef _OPENMP
#pragma omp parallel num_threads(num_threads > 1 && rows > 1 ? num_threads : 1)
#endif
  {
    std::vector<float> estimate(vocab);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int r = 0; r < rows; ++r)
      out[r] = draw_row(logits + static_cast<int64_t>(r) * vocab, vocab, token_hash, keys[r],
                        estimate.data());
  }
}

// The estimate of the noise for n hashes (for the tests' check of its error).
extern "C" void genq_gumbel_estimate(const uint32_t* hashes, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    v8u h;
    std::memcpy(&h, hashes + i, sizeof h);
    const v8 g = noise_estimate(h);
    std::memcpy(out + i, &g, sizeof g);
  }
  for (; i < n; ++i) out[i] = noise_estimate(v8u{hashes[i]})[0];
}
