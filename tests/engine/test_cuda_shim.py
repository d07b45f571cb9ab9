"""The engine through attention_backend="cuda-shim": the unchanged cuda/ kernels, launched by the
same CupyAttentionBackend code as on a GPU (planned once per step, marshalled by
engine.kernels.launch_params), executed by the g++ shim build. Greedy output equals transformers
token for token with head sizes 64 (GQA) and 128 (MQA), for whole and chunked prefill, swap and
recompute preemption (injected and from a small cache), prefix caching, fresh prompts by SDPA, and
a context over 512 tokens; n=2 and beam search (copy-on-write through copy_blocks) equal the torch
backend; bf16 stays within a stated distance of the torch backend's log-probabilities."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.cupy_backend import CupyAttentionBackend
from tests.harness.engine import KV_CACHE_MEMORY, hf_greedy, random_prompts
from tests.harness.models import build_kernel_llama
from tests.kernels.cpu_kernels import CountingLauncher

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# bf16 through the shim vs bf16 through the torch backend: both round activations to bf16 at the
# same points but accumulate attention in a different order, so log-probabilities of the top
# tokens may differ by a few bf16 ulps of the logits (2^-8 relative), never by more than this.
BF16_LOGPROB_TOL = 0.1


def shim_llm(model: Path, **config: object) -> tuple[LLM, CountingLauncher]:
    config.setdefault("swap_space", 0.05)
    llm = LLM(str(model), attention_backend="cuda-shim", block_size=16, **config)
    backend = llm.engine.runner.backend
    assert isinstance(backend, CupyAttentionBackend)
    counting = CountingLauncher(backend.launcher)  # type: ignore[arg-type]
    backend.launcher = counting
    return llm, counting


def build_llama(root: Path, tokenizer_dir: Path, heads: int, kv_heads: int, head: int) -> Path:
    return build_kernel_llama(root, tokenizer_dir, heads, kv_heads, head, tie=True)


@pytest.fixture(scope="module")
def gqa64(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """Head size 64, 4 query heads over 2 KV heads."""
    return build_llama(tmp_path_factory.mktemp("gqa64"), tokenizer_dir, 4, 2, 64)


@pytest.fixture(scope="module")
def mqa128(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """Head size 128, 2 query heads over 1 KV head."""
    return build_llama(tmp_path_factory.mktemp("mqa128"), tokenizer_dir, 2, 1, 128)


PROMPTS = random_prompts(4, seed=5, lo=3, hi=48)


@pytest.fixture(scope="module")
def expected(gqa64: Path, mqa128: Path) -> dict[str, list[list[int]]]:
    return {"gqa64": hf_greedy(gqa64, PROMPTS, MAX_TOKENS),
            "mqa128": hf_greedy(mqa128, PROMPTS, MAX_TOKENS)}


def greedy(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("name", ["gqa64", "mqa128"])
@pytest.mark.parametrize("budget", [2048, 24], ids=["whole-prefill", "chunked-prefill"])
def test_greedy_equals_transformers(request: pytest.FixtureRequest, name: str, budget: int,
                                    expected: dict[str, list[list[int]]]) -> None:
    llm, launched = shim_llm(request.getfixturevalue(name), max_num_batched_tokens=budget)
    assert greedy(llm, PROMPTS) == expected[name]
    assert launched.counts["paged_attention_prefill_kernel"] > 0
    assert launched.counts["paged_attention_decode_kernel"] > 0
    assert launched.counts["reshape_and_cache_kernel"] > 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("cause", ["injected", "small-cache"])
def test_preemption_keeps_greedy_equal_to_transformers(
        gqa64: Path, expected: dict[str, list[list[int]]], mode: str, cause: str) -> None:
    config: dict[str, object] = {"preemption_mode": mode}
    if cause == "injected":
        config.update(artificial_preemption_prob=0.3, artificial_preemption_seed=3)
    else:  # 6 blocks of 16 tokens cannot hold 4 sequences of up to 56 tokens at once
        config.update(num_gpu_blocks_override=6)
    llm, launched = shim_llm(gqa64, **config)
    assert greedy(llm, PROMPTS) == expected["gqa64"]
    stats = llm.stats()
    if mode == "swap":
        assert stats["num_swap_outs"] > 0 and stats["num_swap_ins"] > 0
        assert launched.counts["copy_blocks_kernel"] > 0  # swaps run through copy_blocks
    else:
        assert stats["num_recompute_preemptions"] > 0


def test_prefix_caching_reuses_blocks_and_keeps_greedy_equal_to_transformers(
        gqa64: Path) -> None:
    shared = random_prompts(1, seed=9, lo=40, hi=40)[0]  # 2 full blocks and a partial one
    prompts = [shared + tail for tail in random_prompts(3, seed=10, lo=2, hi=9)]
    llm, _ = shim_llm(gqa64, enable_prefix_caching=True)
    outs = [greedy(llm, [p])[0] for p in prompts]  # one at a time: later ones hit the cache
    assert outs == hf_greedy(gqa64, prompts, MAX_TOKENS)
    assert llm.stats()["num_cached_tokens"] == 2 * 32  # 2 full blocks, for 2 later prompts


def test_context_over_512_tokens_runs_partitions_and_reduce(gqa64: Path) -> None:
    prompts = random_prompts(1, seed=11, lo=520, hi=520)
    llm, launched = shim_llm(gqa64)
    llm.engine.runner.backend.prompts_by_sdpa = True  # (the prompt itself: not the point here)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert greedy(llm, prompts, params) == hf_greedy(gqa64, prompts, 3)
    assert launched.counts["paged_attention_reduce_kernel"] == 2 * 2  # 2 decode steps, 2 layers


def test_fresh_prompts_by_sdpa_keep_greedy_equal_to_transformers(
        gqa64: Path, expected: dict[str, list[list[int]]]) -> None:
    llm, launched = shim_llm(gqa64, max_num_batched_tokens=24)  # whole prompts and chunks
    backend = llm.engine.runner.backend
    assert isinstance(backend, CupyAttentionBackend) and backend.prompts_by_sdpa is None
    backend.prompts_by_sdpa = True  # what a CUDA device does by default
    assert greedy(llm, PROMPTS) == expected["gqa64"]
    assert launched.counts["paged_attention_prefill_kernel"] > 0  # the chunks after the first


def test_n2_and_beam_search_copy_blocks_and_equal_the_torch_backend(gqa64: Path) -> None:
    prompts = random_prompts(2, seed=12, lo=5, hi=30)  # partial last blocks: forks copy them
    sampled = SamplingParams(n=2, temperature=0.8, seed=4, max_tokens=8, ignore_eos=True)
    beams = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0, max_tokens=8,
                           ignore_eos=True)

    def outputs(llm: LLM) -> list[list[list[int]]]:
        return [[list(c.token_ids) for c in o.outputs]
                for params in (sampled, beams) for o in llm.generate(prompts, params,
                                                                      use_tqdm=False)]

    llm, launched = shim_llm(gqa64)
    reference = LLM(str(gqa64), kv_cache_memory=KV_CACHE_MEMORY,
                    attention_backend="torch", block_size=16, swap_space=0.05)
    assert outputs(llm) == outputs(reference)
    assert launched.counts["copy_blocks_kernel"] > 0


def test_bf16_log_probabilities_stay_close_to_the_torch_backend(gqa64: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    prompts = PROMPTS
    runs = []
    for backend in ("cuda-shim", "torch"):
        llm = LLM(str(gqa64), kv_cache_memory=KV_CACHE_MEMORY,
                  attention_backend=backend, dtype="bfloat16", block_size=16,
                  max_num_batched_tokens=32, swap_space=0.05)
        runs.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
    for shim, ref in zip(*runs):
        assert shim.logprobs is not None and ref.logprobs is not None
        # Compared while both saw the same context: up to and including the first step whose
        # greedy picks differ (bf16 rounds differently per CPU, so a near-tie may flip).
        same = next((i for i, (a, b) in enumerate(zip(shim.token_ids, ref.token_ids, strict=True))
                     if a != b), len(ref.token_ids))
        for got, want in zip(shim.logprobs[:same + 1], ref.logprobs[:same + 1]):
            common = got.keys() & want.keys()
            assert len(common) >= 4  # the same top tokens, give or take a near-tie at rank 5
            assert max(abs(got[t] - want[t]) for t in common) <= BF16_LOGPROB_TOL
        if same < len(ref.token_ids):  # a different pick from the same context: a near-tie only
            want = ref.logprobs[same]
            assert shim.token_ids[same] in want
            assert want[ref.token_ids[same]] - want[shim.token_ids[same]] <= 2 * BF16_LOGPROB_TOL


def test_worker_flag_and_config_name_the_backend_and_refuse_what_cannot_run() -> None:
    from engine import EngineConfig
    from engine.attention.selector import select_backend
    from worker.main import build_parser

    args = build_parser().parse_args(["--model", "m", "--attention-backend", "cuda-shim"])
    assert args.attention_backend == "cuda-shim"
    assert build_parser().parse_args(["--model", "m"]).attention_backend is None
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(model="m", attention_backend="shim")
    config = EngineConfig(model="m", attention_backend="cuda-shim", dtype="float32")
    with pytest.raises(ValueError, match="use device='cpu'"):
        select_backend(config, torch.device("cuda"), 64)
    with pytest.raises(ValueError, match="head sizes"):  # no kernel variant for head size 72
        select_backend(config, torch.device("cpu"), 72)


def test_speculated_rows_through_the_kernels_equal_plain_decoding(gqa64: Path) -> None:
    """Speculation runs each query token of a speculated sequence as a decode row of the CUDA
    decode kernel: seeded outputs equal plain decoding on the torch backend."""
    bias = {t: 6.0 for t in (40, 41, 42, 43, 44)}  # (the model then repeats itself)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True,
                             logit_bias=bias) for i in range(len(PROMPTS))]
    plain = LLM(str(gqa64), block_size=16, swap_space=0.05)
    expected = [list(o.outputs[0].token_ids) for o in
                plain.generate(PROMPTS, params, use_tqdm=False)]
    llm, _ = shim_llm(gqa64, speculative_config={"method": "ngram",
                                                 "num_speculative_tokens": 3})
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
