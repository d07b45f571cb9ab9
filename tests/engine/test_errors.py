"""Impossible requests end with a clear error while the rest of the batch completes."""

from __future__ import annotations

import pytest

from engine import Engine, EngineConfig, SamplingParams
from tests.harness.engine import KV_CACHE_MEMORY, assert_drained, hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_prompt_over_max_model_len_errors_and_others_complete(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, max_model_len=32)
    good = random_prompts(3, seed=2, lo=4, hi=12)
    long = random_prompts(1, seed=3, lo=40, hi=40)[0]
    outs = llm.generate([good[0], long, good[1], good[2]], GREEDY, use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error"
    assert outs[1].error == ("the prompt has 40 tokens but max_model_len is 32: it leaves no "
                             "room to generate; shorten it")
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 3)] == hf_greedy(tiny_llama, good, 8)


def test_generation_stops_at_max_model_len(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, max_model_len=20)
    prompt = random_prompts(1, seed=4, lo=15, hi=15)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_prompt_larger_than_the_whole_cache_errors_and_others_complete(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, block_size=8, num_gpu_blocks_override=4, watermark=0.0)
    good = random_prompts(2, seed=5, lo=4, hi=8)
    big = random_prompts(1, seed=6, lo=60, hi=60)[0]
    outs = llm.generate([big] + good, GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "needs 8 KV blocks of 8 tokens but the cache holds only 4" in outs[0].error
    assert [o.outputs[0].token_ids for o in outs[1:]] == hf_greedy(tiny_llama, good, 8)


def test_abort_frees_blocks_and_the_request_is_gone(tiny_llama):
    engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                 swap_space=0.01))
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("b", [8, 9], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for _ in range(2):
        engine.step()
    assert engine.stats()["num_free_blocks"] < engine.stats()["num_total_blocks"]
    assert engine.abort("a") is True and engine.abort("a") is False
    finished = [o for _ in range(5) for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["b"]
    assert_drained(engine)


@pytest.mark.parametrize("prompt,message", [
    ([], "the prompt is empty"),
    ([1, 99999], "token id 99999 is outside the vocabulary"),
    ("", "the prompt is empty"),
    ([1.5], "prompt must be a string or a list of token ids"),
])
def test_unusable_prompts_raise_value_error(tiny_llama, prompt, message):
    engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                 swap_space=0.01))
    with pytest.raises(ValueError, match=message):
        engine.add_request("x", prompt, GREEDY)
    assert not engine.has_unfinished()


def test_duplicate_request_id_is_refused(tiny_llama):
    engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                 swap_space=0.01))
    engine.add_request("x", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("x", [5, 6], GREEDY)
    engine.abort("x")


@pytest.mark.parametrize("field,value,message", [
    ("dtype", "float64", "dtype must be one of"),
    ("block_size", 12, "block_size must be a power of two"),
    ("preemption_mode", "maybe", "preemption_mode must be one of"),
    ("max_num_seqs", 0, "max_num_seqs must be at least 1"),
])
def test_invalid_engine_config_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **{field: value})


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=1, n=3, best_of=5, max_tokens=4),
    SamplingParams(temperature=0, use_beam_search=True, best_of=5, max_tokens=4),
], ids=["best_of", "beam"])
def test_more_sequences_than_max_num_seqs_errors_and_others_complete(tiny_llama, make_llm,
                                                                     params):
    llm = make_llm(tiny_llama, max_num_seqs=4)
    good = random_prompts(2, seed=7, lo=4, hi=8)
    outs = llm.generate([good[0], good[1], good[0]], [GREEDY, params, GREEDY], use_tqdm=False)
    assert [c.finish_reason for c in outs[1].outputs] == ["error"]
    what = "the beam width (best_of)" if params.use_beam_search else "best_of"
    assert outs[1].error == (f"the request runs 5 sequences ({what}) but max_num_seqs is 4; "
                             "lower n/best_of or raise max_num_seqs")
    expected = hf_greedy(tiny_llama, good[:1], 8)[0]
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids == expected


@pytest.mark.parametrize("stream_text", [False, True], ids=["decoded_once", "streamed"])
def test_request_that_outgrows_the_cache_ends_with_length_and_its_text(tiny_llama, make_llm,
                                                                      stream_text):
    from transformers import AutoTokenizer

    # 4 blocks of 8 tokens hold 32: a 10-token prompt computes 22 more, samples the 23rd,
    # and the scheduler ends it (its text was "" when decoded once, as the offline LLM does).
    llm = make_llm(tiny_llama, block_size=8, num_gpu_blocks_override=4, watermark=0.0,
                   stream_text=stream_text)
    prompt = random_prompts(1, seed=4, lo=10, hi=10)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    expected = hf_greedy(tiny_llama, [prompt], 23)[0]
    text = AutoTokenizer.from_pretrained(str(tiny_llama)).decode(expected)
    assert (out.token_ids, out.text, out.finish_reason) == (expected, text, "length")
    assert llm.stats()["num_infeasible"] == 1


def test_stop_token_ids_outside_the_vocabulary_are_refused(tiny_llama, make_llm):
    """Banned under min_tokens, such an id indexed past the logits and made step() raise for
    the whole batch."""
    llm = make_llm(tiny_llama)
    engine = llm.engine
    with pytest.raises(ValueError, match=rf"stop_token_ids holds 1000000, outside the "
                                         rf"vocabulary \[0, {engine.vocab_size}\)"):
        engine.add_request("bad", [5, 6, 7], SamplingParams(min_tokens=2, max_tokens=4,
                                                            stop_token_ids=[3, 1_000_000]))
    assert not engine.has_unfinished()


def test_abort_all_recovers_from_a_step_that_raised_inside_the_scheduler(tiny_llama):
    """A failure half-way through scheduling leaves groups in no queue (abort() cannot find
    them, their blocks stay taken); abort_all starts over clean and the engine serves again."""
    engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                 block_size=16, swap_space=0.01))
    short = random_prompts(2, seed=21, lo=4, hi=6)
    full_block = random_prompts(1, seed=22, lo=16, hi=16)  # its first decode needs a new block
    for i, prompt in enumerate(short + full_block):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.step()  # the prefills

    def broken_make_room(*args, **kwargs):
        raise RuntimeError("injected")

    # The general path, after the fast path took r0 and r1.
    engine.scheduler._make_room = broken_make_room
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    for i in range(3):  # abort() finds them in no queue: their blocks stay taken
        engine.abort(f"r{i}")
    assert not engine.has_unfinished()
    assert engine.stats()["num_free_blocks"] < engine.stats()["num_total_blocks"]
    engine.abort_all()
    assert_drained(engine)
    assert engine.stats()["num_running"] == 0
    engine.add_request("again", short[0], GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].outputs[0].token_ids == hf_greedy(tiny_llama, [short[0]], 8)[0]
    assert_drained(engine)


def test_a_checkpoint_tensor_the_model_would_not_use_is_refused(tiny_llama, tmp_path):
    """A weight the config does not announce (here an o_proj bias with attention_bias off)
    would be dropped silently and the outputs would differ from transformers: refused."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path / "extra"
    shutil.copytree(tiny_llama, path)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"the checkpoint holds 1 tensor\(s\) this Llama-family "
                       r"model does not use \(e.g. model.layers.0.self_attn.o_proj.bias\)"):
        Engine(EngineConfig(model=str(path), kv_cache_memory=KV_CACHE_MEMORY, swap_space=0.01))
