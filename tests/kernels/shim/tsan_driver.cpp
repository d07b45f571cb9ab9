// Runs every kernel of cuda/ once on small inputs, for the ThreadSanitizer build of the shim
// (tests/kernels/test_tsan.py). Exit status 0 when every output is finite; TSan reports races on
// stderr (and exits with its own status).
#include "cuda_cpu_shim.h"

#include "paged_attention.cu"
#include "cache_kernels.cu"

#include <cstdio>
#include <vector>

namespace {

std::vector<float> random_floats(std::size_t n, unsigned int seed) {
  std::vector<float> v(n);
  for (auto& x : v) {
    seed = seed * 1664525u + 1013904223u;
    x = static_cast<float>(seed >> 8) / 8388608.f - 1.f;  // [-1, 1)
  }
  return v;
}

std::vector<genq::bf16_t> to_bf16(const std::vector<float>& v) {
  std::vector<genq::bf16_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i].bits = genq::float_to_bf16_bits(v[i]);
  return out;
}

bool all_finite(const float* p, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(p[i])) return false;
  }
  return true;
}

// Sequence i owns blocks i * blocks_per_seq ... (identity block table).
std::vector<int> identity_table(int num_seqs, int blocks_per_seq) {
  std::vector<int> t(num_seqs * blocks_per_seq);
  for (int i = 0; i < num_seqs * blocks_per_seq; ++i) t[i] = i;
  return t;
}

template <typename T, int HEAD, int BLOCK>
bool decode(const std::vector<int>& seq_lens, int num_heads, int num_kv_heads,
            int heads_per_cta) {
  const int num_seqs = static_cast<int>(seq_lens.size());
  int max_len = 0;
  for (int n : seq_lens) max_len = n > max_len ? n : max_len;
  const int blocks_per_seq = (max_len + BLOCK - 1) / BLOCK;
  const int partitions = (max_len + genq::kPartitionSize - 1) / genq::kPartitionSize;
  const std::size_t cache_elems =
      static_cast<std::size_t>(num_seqs) * blocks_per_seq * BLOCK * num_kv_heads * HEAD;
  std::vector<float> kf = random_floats(cache_elems, 1), vf = random_floats(cache_elems, 2);
  std::vector<float> qf = random_floats(static_cast<std::size_t>(num_seqs) * num_heads * HEAD, 3);
  std::vector<T> k(cache_elems), v(cache_elems), q(qf.size()), out(qf.size());
  if constexpr (std::is_same_v<T, float>) {
    k = kf, v = vf, q = qf;
  } else {
    k = to_bf16(kf), v = to_bf16(vf), q = to_bf16(qf);
  }
  const std::vector<int> table = identity_table(num_seqs, blocks_per_seq);
  std::vector<float> tmp(qf.size() * partitions), max_logits(num_seqs * num_heads * partitions),
      exp_sums(max_logits.size());
  cuda_shim::launch(dim3(num_heads / heads_per_cta, num_seqs, partitions),
                    dim3(genq::kDecodeThreads),
                    genq::paged_attention_decode_kernel<T, HEAD, BLOCK>, out.data(), tmp.data(),
                    max_logits.data(), exp_sums.data(), q.data(), k.data(), v.data(),
                    table.data(), seq_lens.data(), num_kv_heads, blocks_per_seq, partitions,
                    num_heads * HEAD, 0.125f, heads_per_cta);
  if (partitions > 1) {
    cuda_shim::launch(dim3(num_heads, num_seqs), dim3(genq::kReduceThreads),
                      genq::paged_attention_reduce_kernel<T, HEAD>, out.data(), tmp.data(),
                      max_logits.data(), exp_sums.data(), seq_lens.data(), partitions);
  }
  std::vector<float> result(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) {
    if constexpr (std::is_same_v<T, float>) {
      result[i] = out[i];
    } else {
      result[i] = genq::bf16_bits_to_float(out[i].bits);
    }
  }
  return all_finite(result.data(), result.size());
}

// One sequence: a cached context of seq_len - q_len tokens plus a chunk of q_len queries.
template <int HEAD, int BLOCK>
bool prefill(int seq_len, int q_len, int num_heads, int num_kv_heads) {
  const int blocks = (seq_len + BLOCK - 1) / BLOCK;
  const std::size_t cache_elems = static_cast<std::size_t>(blocks) * BLOCK * num_kv_heads * HEAD;
  std::vector<float> k = random_floats(cache_elems, 4), v = random_floats(cache_elems, 5);
  std::vector<float> q = random_floats(static_cast<std::size_t>(q_len) * num_heads * HEAD, 6);
  std::vector<float> out(q.size());
  const std::vector<int> table = identity_table(1, blocks), seq_lens{seq_len}, starts{0, q_len};
  constexpr int tile = genq::PrefillLayout<HEAD>::kQueryTile;
  cuda_shim::launch(dim3(num_heads, 1, (q_len + tile - 1) / tile), dim3(genq::kPrefillThreads),
                    genq::paged_attention_prefill_kernel<float, HEAD, BLOCK>, out.data(),
                    q.data(), k.data(), v.data(), table.data(), seq_lens.data(), starts.data(), 0,
                    num_kv_heads, blocks, num_heads * HEAD, 0.125f);
  return all_finite(out.data(), out.size());
}

bool cache_kernels() {
  // 4 tokens of 2 x 64 floats (32 vectors) into a cache of 8 slots; token 2 is padding.
  std::vector<float> key = random_floats(4 * 128, 7), value = random_floats(4 * 128, 8);
  std::vector<float> key_cache(8 * 128), value_cache(8 * 128);
  const std::vector<long long> slots{5, 0, -1, 7};
  cuda_shim::launch(dim3(4), dim3(genq::kCacheThreads), genq::reshape_and_cache_kernel,
                    reinterpret_cast<const uint4*>(key.data()),
                    reinterpret_cast<const uint4*>(value.data()),
                    reinterpret_cast<uint4*>(key_cache.data()),
                    reinterpret_cast<uint4*>(value_cache.data()), slots.data(), 32, 32LL, 32LL);
  // 2 layers x K/V planes of 4 blocks of 256 floats (64 vectors); copy 0 -> 3 and 1 -> 2.
  std::vector<float> cache = random_floats(2 * 2 * 4 * 256, 9);
  const std::vector<long long> pairs{0, 3, 1, 2};
  cuda_shim::launch(dim3(2, 4), dim3(genq::kCacheThreads), genq::copy_blocks_kernel,
                    reinterpret_cast<const uint4*>(cache.data()),
                    reinterpret_cast<uint4*>(cache.data()), pairs.data(), 4 * 64LL, 4 * 64LL,
                    64LL);
  return key_cache[5 * 128] == key[0] && cache[3 * 256] == cache[0];
}

}  // namespace

int main() {
  bool ok = true;
  ok &= decode<float, 64, 16>({20, 513}, 4, 1, 4);   // 4 heads per CTA; 1 and 2 partitions
  ok &= decode<genq::bf16_t, 128, 32>({45}, 2, 2, 1);  // 1 head per CTA
  ok &= prefill<64, 8>(40, 20, 2, 1);                 // 2 query tiles, 2 key tiles
  ok &= cache_kernels();
  std::printf(ok ? "kernels ran, outputs finite\n" : "non-finite output\n");
  return ok ? 0 : 1;
}
