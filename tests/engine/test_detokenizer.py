"""Streaming text: whole characters only in each delta, stop strings across token boundaries."""

from __future__ import annotations

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.detokenizer import decode_delta, init_offsets
from engine.sequence import Sequence
from engine.tokenizer import fast_decoder
from tests.harness.engine import EOS_ID, KV_CACHE_MEMORY, assert_drained, random_prompts


@pytest.mark.parametrize("fast", [False, True], ids=["tokenizer", "backend"])
def test_characters_split_across_tokens_stream_whole(tiny_llama, fast):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    decoder = fast_decoder(tok) if fast else tok
    text = " 日本語 and 🙂 then Жψ 🚀 中文 ✓"  # the last ones are not in the BPE vocab
    ids = tok(text).input_ids
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    prompt = tok("the fox").input_ids
    seq = Sequence(0, 0, list(prompt), len(prompt))
    init_offsets(seq)
    deltas = []
    for token in ids:
        seq.token_ids.append(token)
        deltas.append(decode_delta(decoder, seq, skip_special_tokens=True))
    assert "".join(deltas) == tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # a token ending mid-character released nothing yet


def test_stop_string_spanning_tokens_truncates_text_and_stops(tiny_llama):
    engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                 swap_space=0.01))
    prompt = random_prompts(1, seed=12)[0]
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    engine.add_request("free", prompt, free)
    full = _run(engine)["free"].outputs[0]
    tokens = full.token_ids
    pieces = [engine.tokenizer.decode(tokens[:i]) for i in range(len(tokens) + 1)]
    # A stop string made of the last 2 characters of token i's text and the first of token i+1's.
    candidates = [i for i in range(1, len(tokens) - 1)
                  if "\ufffd" not in pieces[i + 2] and len(pieces[i + 1]) - len(pieces[i]) >= 2
                  and len(pieces[i + 2]) > len(pieces[i + 1])
                  and pieces[i + 2].find(pieces[i + 2][len(pieces[i + 1]) - 2:
                                                       len(pieces[i + 1]) + 1])
                  == len(pieces[i + 1]) - 2]
    assert candidates, full.text
    cut = len(pieces[candidates[0] + 1])
    stop = full.text[cut - 2:cut + 1]
    first = full.text.find(stop)
    assert first == cut - 2
    engine.add_request("stopped", prompt, SamplingParams(temperature=1.0, seed=3,
                                                         max_tokens=24, ignore_eos=True,
                                                         stop=[stop]))
    out = _run(engine)["stopped"].outputs[0]
    assert out.text == full.text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    ends = [i for i, p in enumerate(pieces) if len(p) >= first + len(stop)]
    assert out.token_ids == tokens[:ends[0]]
    assert_drained(engine)


def _run(engine: Engine) -> dict:
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_final_text_is_the_same_streamed_or_decoded_once(tiny_llama, make_llm):
    prompts = random_prompts(8, seed=13)
    params = SamplingParams(temperature=1.0, seed=8, max_tokens=20, ignore_eos=True)
    once = make_llm(tiny_llama).generate(prompts, params, use_tqdm=False)
    streamed = make_llm(tiny_llama, stream_text=True).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in once] == [o.outputs[0].token_ids for o in streamed]
    assert [o.outputs[0].text for o in once] == [o.outputs[0].text for o in streamed]
    assert any(o.outputs[0].text for o in once)


def test_first_tokens_decode_the_same_through_the_byte_table_after_any_prompt_tail(tiny_llama):
    # The byte path starts at the first output when the prompt's tail is whole characters of
    # ordinary tokens; tails ending mid-character or holding an added token take the decoder.
    import random

    from transformers import AutoTokenizer

    from engine.tokenizer import byte_table

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    decoder = fast_decoder(tok)
    table = byte_table(tok, decoder)
    assert table is not None
    byte = {data: i for i, data in enumerate(table.token_bytes) if data is not None}
    sun = [byte[bytes([b])] for b in "日".encode()]  # one token per byte: pieces of a character
    chars = tok("日本語🙂é").input_ids
    fox = tok("the fox").input_ids
    tails = [fox, fox + sun[:1], sun[:2], [0] + fox, fox + [1], chars, [0], fox[:1]]
    rng = random.Random(5)
    for prompt in tails:
        outputs = sun[1:] + [rng.choice(chars + fox + sun + [1]) for _ in range(6)]
        runs = []
        for use in (None, table):
            seq = Sequence(0, 0, list(prompt), len(prompt))
            init_offsets(seq)
            deltas = []
            for token in outputs:
                seq.token_ids.append(token)
                deltas.append(decode_delta(decoder, seq, True, use))
            runs.append((deltas, seq.prefix_offset, seq.read_offset))
        assert runs[0] == runs[1], prompt


@pytest.mark.parametrize("stream_text", [False, True], ids=["decoded_once", "streamed"])
@pytest.mark.parametrize("include", [False, True], ids=["excluded", "included"])
def test_include_stop_str_in_output_shows_the_stop_token_or_eos_text(eos_llama, include,
                                                                      stream_text):
    # vLLM: the token that stopped a sequence (EOS or one of stop_token_ids) stays in
    # token_ids; its text is in the output text only with include_stop_str_in_output.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = random_prompts(1, seed=11, lo=5, hi=10)[0]
    model = AutoModelForCausalLM.from_pretrained(str(eos_llama), dtype=torch.float32)
    hf = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                        max_new_tokens=8, min_new_tokens=2, do_sample=False,
                        eos_token_id=EOS_ID, pad_token_id=2)[0, len(prompt):].tolist()
    assert hf[-1] == EOS_ID and len(hf) < 8  # the model stops on EOS after min_tokens
    text = AutoTokenizer.from_pretrained(str(eos_llama)).decode(hf if include else hf[:-1])
    engine = Engine(EngineConfig(model=str(eos_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                 stream_text=stream_text, swap_space=0.01))
    common = dict(temperature=0, max_tokens=8, min_tokens=2, include_stop_str_in_output=include)
    engine.add_request("eos", prompt, SamplingParams(**common))
    engine.add_request("token", prompt, SamplingParams(**common, ignore_eos=True,
                                                       stop_token_ids=[EOS_ID]))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason)
            for c in (done["eos"], done["token"])] == [(hf, text, "stop", None),
                                                        (hf, text, "stop", EOS_ID)]
    assert_drained(engine)
