"""Constrained jobs in the fleet: a kill -9 mid-generation moves them to another worker, whose
replay rebuilds each matcher from the tokens and gives the offline engine's output; a bad grammar
is an invalid_params error and the worker serves on."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from producer import Client, JobError
from tests.harness.fleet import (
    Expected,
    RedisServer,
    WorkerFactory,
    as_expected,
    pending_of,
    stream_all,
    wait_for,
    wait_heartbeats,
)
from tests.harness.models import corpus

# Long enough (40 one-digit items) that no job ends between "held and streaming" and the kill.
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "minItems": 40, "maxItems": 40}


def constrained_params(i: int) -> dict[str, Any]:
    grammar = {"json": DIGITS} if i % 3 else {"regex": "([a-z]{3} ){30}[a-z]{3}"}
    if i % 2 == 0:
        return {"temperature": 0, "max_tokens": 200, "structured_outputs": grammar}
    return {"temperature": 0.9, "seed": 500 + i, "n": 1 + i % 4 // 3, "max_tokens": 200,
            "structured_outputs": grammar}


def test_kill_9_moves_constrained_jobs_and_the_survivor_gives_the_offline_output(
        redis_server: RedisServer, workers: WorkerFactory, tiny_llama: Path,
        offline: Callable[[list[str], Any], list[Expected]]) -> None:
    victim = workers.start(redis_server.url, tiny_llama, "w1", "--max-num-seqs", "16",
                           "--result-ttl", "600")
    survivor = workers.start(redis_server.url, tiny_llama, "w2", "--max-num-seqs", "4",
                             "--result-ttl", "600")
    wait_heartbeats(redis_server, [victim, survivor])
    prompts = corpus(12, seed=3)
    params = [constrained_params(i) for i in range(12)]
    client = Client(redis_server.url)
    jobs = [client.submit(p, q, model="tiny") for p, q in zip(prompts, params, strict=True)]
    seen, threads = stream_all(jobs, timeout=300)
    wait_for(lambda: pending_of(redis_server, "w1") >= 6
             and any(e["type"] == "tokens" for job in jobs for e in seen[job.id]),
             timeout=60, interval=0.01, what="w1 holding constrained jobs mid-generation")
    victim.kill9()
    for t in threads:
        t.join(300)
    expected = offline(prompts, params)
    for job, param, want in zip(jobs, params, expected, strict=True):
        final = seen[job.id][-1]
        assert final["type"] == "done", final
        assert as_expected(final) == want, job.id
        for _ids, text, reason in want:
            assert reason == "stop"
            if "json" in param["structured_outputs"]:
                jsonschema.validate(json.loads(text), DIGITS)
    moved = [job for job in jobs if seen[job.id][-1]["attempt"] == 2]  # (w1's, replayed)
    assert len(moved) >= 6 and survivor.alive()


BAD = [({"structured_outputs": {"json": {"type": "object", "not": {}}}}, "Unimplemented keys"),
       ({"structured_outputs": {"regex": "[a-"}}, "unclosed character class"),
       ({"logit_bias": {"99999": 1}}, "logit_bias holds 99999, outside the vocabulary")]


def test_a_bad_grammar_is_invalid_params_and_the_worker_serves_on(
        redis_server: RedisServer, workers: WorkerFactory, tiny_llama: Path) -> None:
    worker = workers.start(redis_server.url, tiny_llama, "w1", "--max-grammar-bytes", "200")
    wait_heartbeats(redis_server, [worker])
    client = Client(redis_server.url)
    for params, words in BAD:
        with pytest.raises(JobError) as err:
            client.submit("x", params, model="tiny").result(timeout=120)
        assert err.value.code == "invalid_params" and words in err.value.message
    big = {"structured_outputs": {"choice": ["a" * 50] * 4}}  # 220 bytes as compact JSON
    with pytest.raises(JobError) as err:
        client.submit("x", big, model="tiny").result(timeout=120)
    assert err.value.code == "limit_exceeded" and "over the cap of 200" in err.value.message
    done = client.submit("x", {"temperature": 0, "max_tokens": 3,
                               "structured_outputs": {"regex": "[0-9]+"}},
                         model="tiny").result(timeout=120)
    assert done["outputs"][0]["text"].isdigit() and worker.alive()


def test_the_wire_carries_structured_outputs_logit_bias_and_allowed_token_ids() -> None:
    from engine import SamplingParams
    from producer.job_params import check_params
    from producer.limits import Limits, check_limits
    from producer.protocol import JobSpec, ProtocolError

    params = check_params({"structured_outputs": {"json": {"type": "object"}},
                           "logit_bias": {5: -100, "7": 2.5}, "allowed_token_ids": [1, 2]})
    assert params["logit_bias"] == {"5": -100, "7": 2.5}  # (MessagePack maps here: str keys)
    engine_params = SamplingParams.from_dict(params)
    assert engine_params.logit_bias == {5: -100.0, 7: 2.5}
    assert engine_params.structured_outputs is not None
    assert engine_params.structured_outputs.json == {"type": "object"}
    with pytest.raises(ProtocolError, match="structured_outputs must be a map with one of"):
        check_params({"structured_outputs": {"json": {}, "regex": "a"}})
    spec = JobSpec(id="j", model="m", prompt="x", params={"structured_outputs": {"regex": "ab"}})
    check_limits(spec, Limits(max_grammar_bytes=14))  # {"regex":"ab"}: 14 bytes
    with pytest.raises(ProtocolError, match="15 bytes .* over the cap of 14"):
        check_limits(JobSpec(id="j", model="m", prompt="x",
                             params={"structured_outputs": {"regex": "abc"}}),
                     Limits(max_grammar_bytes=14))
