"""A bad job never stops a worker: when engine.step() raises, the worker (worker/quarantine.py)
ends only the job(s) at fault with an engine_error event, and every other job completes with the
offline LLM.generate output, streamed once per (index, pos); an engine that fails whatever it runs
makes the worker exit non-zero, and another worker completes its jobs.

The fault: the engine's real sampler, wrapped so that it raises when the batch holds a row of a
marked request (its seed) at or past a given output position (fault injection into a real engine
on the tiny llama, run by a real Worker on a thread against a real redis-server). One test uses a
real input that makes step() raise today, through a `genq worker` process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampler import Sampler, SampleResult, SampleRow
from producer import Client, Job, JobError
from producer.protocol import Keys, decode_heartbeat
from tests.harness.fleet import (
    Expected,
    RedisServer,
    WorkerFactory,
    as_expected,
    reply_events,
    wait_for,
    wait_heartbeats,
)
from worker.config import WorkerConfig
from worker.loop import Worker
from worker.quarantine import EXIT_ENGINE_BROKEN

KEYS = Keys(model="tiny")  # (the jobs of the replies here: model tiny's)
MARK, MARK2 = 424_242, 515_151  # seeds that mark poisoned jobs
GOOD: list[tuple[str, dict[str, Any]]] = [
    ("the quick brown fox", {"temperature": 0, "max_tokens": 12, "ignore_eos": True}),
    ("over a lazy dog", {"temperature": 0.8, "seed": 7, "max_tokens": 10, "ignore_eos": True}),
    ("redis streams carry", {"temperature": 0.9, "seed": 3, "n": 2, "max_tokens": 9,
                             "ignore_eos": True}),
    ("tokens to every worker", {"temperature": 0, "max_tokens": 14, "ignore_eos": True,
                                "logprobs": 2}),
    ("the engine batches", {"temperature": 0, "max_tokens": 8, "stop": [" the"]}),
]


class PoisonedSampler:
    """The engine's own sampler, raising when a row of a marked request (by seed) reaches the
    output position given for its mark; with `always`, raising on every call."""

    def __init__(self, sampler: Sampler, marks: dict[int, int], always: bool = False) -> None:
        self.sampler = sampler
        self.marks = marks
        self.always = always

    def __call__(self, logits: Any, rows: list[SampleRow]) -> SampleResult:
        if self.always:
            raise RuntimeError("the device is gone")
        for row in rows:
            start = self.marks.get(row.seed)
            if start is not None and row.position >= start:
                raise ZeroDivisionError(f"poisoned row (seed {row.seed}, position {row.position})")
        return self.sampler(logits, rows)

    def greedy(self, logits: Any) -> list[int]:  # (plain greedy batches: no rows, no seeds)
        if self.always:
            raise RuntimeError("the device is gone")
        return self.sampler.greedy(logits)


class ThreadWorker:
    """A real Worker (real engine on the tiny llama) running on a thread of the test process."""

    def __init__(self, server: RedisServer, model: Path, name: str,
                 poison: Callable[[Sampler], PoisonedSampler] | None = None) -> None:
        self.engine = Engine(EngineConfig(model=str(model), device="cpu", max_num_seqs=8,
                                          num_gpu_blocks_override=256, swap_space=0.01,
                                          num_threads=1, output_kind="delta"))
        if poison is not None:
            self.engine.step_sampler.sampler = poison(  # type: ignore[assignment]
                self.engine.step_sampler.sampler)
        self.worker = Worker(self.engine, WorkerConfig(
            redis_url=server.url, served_model_name="tiny", name=name, heartbeat_ttl=2.0,
            reclaim_interval=0.5, result_ttl=60, drain_timeout=10.0, block_ms=100))
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, name=f"worker-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.code = self.worker.run()

    def stop(self, timeout: float = 60.0) -> int | None:
        self.worker.request_stop()
        self.thread.join(timeout)
        return self.code

    def idle(self) -> dict[str, Any] | None:
        """The engine's stats once the worker holds nothing (else None)."""
        w = self.worker
        if len(w.held) or w.engine.has_unfinished():
            return None
        return dict(w.engine.stats())


@pytest.fixture
def thread_workers() -> Iterator[list[ThreadWorker]]:
    started: list[ThreadWorker] = []
    yield started
    for tw in started:
        tw.stop()


def submit(server: RedisServer, jobs: list[tuple[str, dict[str, Any]]]) -> list[Job]:
    client = Client(server.url)
    return [client.submit(prompt, params, model="tiny") for prompt, params in jobs]


def poisoned(seed: int) -> tuple[str, dict[str, Any]]:
    # (sampled: plain greedy rows skip the sampler's rows, where the poison is)
    return ("a poisoned job", {"temperature": 0.8, "seed": seed, "max_tokens": 12,
                               "ignore_eos": True})


def assert_streamed_once(server: RedisServer, job: Job, result: dict[str, Any]) -> None:
    """The reply stream holds each (index, pos) once, in order, adding up to the done outputs;
    Job.stream() yields the same tokens and text, with no restart."""
    written: dict[int, list[int]] = {}
    for e in reply_events(server, job.id):
        if e["type"] == "tokens":
            ids = written.setdefault(e["index"], [])
            assert e["pos"] == len(ids), (job.id, e["index"], e["pos"], len(ids))
            ids += e["token_ids"]
    assert written == {o["index"]: o["token_ids"] for o in result["outputs"]}
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    kinds = []
    for e in job.stream(timeout=30):
        kinds.append(e["type"])
        if e["type"] == "tokens":
            tokens[e["index"]] = tokens.get(e["index"], []) + e["token_ids"]
            texts[e["index"]] = texts.get(e["index"], "") + e["text"]
    assert "restart" not in kinds and kinds[0] == "started" and kinds[-1] == "done"
    assert tokens == written
    assert texts == {o["index"]: o["text"] for o in result["outputs"]}


def assert_clean(server: RedisServer, tw: ThreadWorker) -> None:
    """Every KV block free, nothing pending in Redis, nothing dead-lettered."""
    stats = wait_for(tw.idle, timeout=30, what="an idle worker")
    assert stats is not None
    assert (stats["num_free_blocks"], stats["num_running"], stats["num_waiting"],
            stats["num_swapped"]) == (stats["num_total_blocks"], 0, 0, 0)
    conn = server.client()
    wait_for(lambda: conn.xpending(KEYS.jobs("tiny"), "workers")["pending"] == 0, timeout=10,
             what="every entry acked")
    assert conn.xlen(KEYS.dead("tiny")) == 0


def engine_error(job: Job) -> JobError:
    with pytest.raises(JobError) as exc:
        job.result(timeout=60)
    assert exc.value.code == "engine_error"
    return exc.value


def test_a_poisoned_job_ends_with_engine_error_and_every_other_job_matches_offline(
        redis_server: RedisServer, tiny_llama: Path, thread_workers: list[ThreadWorker],
        offline: Callable[..., list[Expected]], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="genq.worker")
    expected = offline([p for p, _ in GOOD], [params for _, params in GOOD])
    # Submitted before the worker starts, so one read takes them all into one batch. The poison
    # fails at its 4th token: by then every job has streamed 3 tokens, and the re-runs must not
    # stream those again.
    jobs = submit(redis_server, GOOD + [poisoned(MARK)])
    tw = ThreadWorker(redis_server, tiny_llama, "inproc",
                      poison=lambda s: PoisonedSampler(s, {MARK: 3}))
    thread_workers.append(tw)
    error = engine_error(jobs[-1])
    assert error.message == ("the engine failed on this job: ZeroDivisionError: poisoned row "
                             "(seed 424242, position 3)")
    for job, want in zip(jobs[:-1], expected, strict=True):
        result = job.result(timeout=60)
        assert result["attempt"] == 1 and as_expected(result) == want
        assert_streamed_once(redis_server, job, result)
    streamed: list[int] = []  # the poison's first run: 3 tokens, then nothing more
    for e in reply_events(redis_server, jobs[-1].id):
        if e["type"] == "tokens":
            assert e["pos"] == len(streamed)
            streamed += e["token_ids"]
    assert len(streamed) == 3
    # {g0..g4 P} fails -> {g0 g1 g2} passes, {g3 g4 P} fails -> {g3 g4} passes, {P} fails.
    counters = tw.worker.counters
    assert (counters["engine_failures"], counters["culprits"]) == (3, 1)
    assert tw.worker.quarantine.behind == {}  # (every re-run ended: nothing left to resume)
    tracebacks = [r for r in caplog.records if r.exc_info and "poisoned row" in r.getMessage()]
    assert len(tracebacks) == 1  # logged once with its traceback, then one line per failure
    # The worker serves on: new jobs, the same outputs as offline.
    later: list[tuple[str, dict[str, Any]]] = [
        ("a lazy dog", {"temperature": 0, "max_tokens": 6}),
        ("the fleet", {"temperature": 0.7, "seed": 11, "max_tokens": 6})]
    for job, want in zip(submit(redis_server, later),
                         offline([p for p, _ in later], [q for _, q in later]), strict=True):
        assert as_expected(job.result(timeout=60)) == want
    assert_clean(redis_server, tw)
    assert tw.stop() == 0


def test_two_poisoned_jobs_are_both_found_and_the_others_complete(
        redis_server: RedisServer, tiny_llama: Path, thread_workers: list[ThreadWorker],
        offline: Callable[..., list[Expected]]) -> None:
    good = GOOD[:4]
    expected = offline([p for p, _ in good], [params for _, params in good])
    mixed = [good[0], poisoned(MARK), good[1], good[2], poisoned(MARK2), good[3]]
    jobs = submit(redis_server, mixed)
    # The first poison fails at its first token, the second at its third.
    tw = ThreadWorker(redis_server, tiny_llama, "inproc2",
                      poison=lambda s: PoisonedSampler(s, {MARK: 0, MARK2: 2}))
    thread_workers.append(tw)
    messages = [engine_error(jobs[i]).message for i in (1, 4)]
    assert messages == [
        "the engine failed on this job: ZeroDivisionError: poisoned row (seed 424242, position 0)",
        "the engine failed on this job: ZeroDivisionError: poisoned row (seed 515151, "
        "position 2)"]
    for job, want in zip([jobs[i] for i in (0, 2, 3, 5)], expected, strict=True):
        result = job.result(timeout=60)
        assert as_expected(result) == want
        assert_streamed_once(redis_server, job, result)
    # {g0 P1 g1 g2 P2 g3} -> {g0 P1 g1} -> {g0 P1} -> {P1}; then {g2 P2 g3} -> {g2 P2} -> {P2}.
    counters = tw.worker.counters
    assert (counters["engine_failures"], counters["culprits"]) == (7, 2)
    assert_clean(redis_server, tw)


def test_an_engine_that_always_fails_exits_non_zero_and_another_worker_serves_its_jobs(
        redis_server: RedisServer, tiny_llama: Path, thread_workers: list[ThreadWorker],
        offline: Callable[..., list[Expected]], caplog: pytest.LogCaptureFixture) -> None:
    good = GOOD[:3]
    expected = offline([p for p, _ in good], [params for _, params in good])
    jobs = submit(redis_server, good)
    broken = ThreadWorker(redis_server, tiny_llama, "broken",
                          poison=lambda s: PoisonedSampler(s, {}, always=True))
    thread_workers.append(broken)
    broken.thread.join(60)
    assert not broken.thread.is_alive() and broken.code == EXIT_ENGINE_BROKEN
    # {j0 j1 j2} fails -> {j0 j1} fails -> {j0} fails, and so does the probe: no job is blamed.
    assert (broken.worker.counters["engine_failures"], broken.worker.counters["culprits"]) == (3, 0)
    line = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(line) == 1 and line[0].startswith("the engine is broken: engine.step() failed "
                                                 "(RuntimeError: the device is gone) and so did "
                                                 "a probe request of the worker's own")
    for job in jobs:
        assert [e["type"] for e in reply_events(redis_server, job.id)] == ["started"]
    assert not redis_server.client().exists(KEYS.worker("tiny", "broken"))  # its heartbeat is gone
    healthy = ThreadWorker(redis_server, tiny_llama, "healthy")
    thread_workers.append(healthy)
    for job, want in zip(jobs, expected, strict=True):
        result = job.result(timeout=60)
        assert result["attempt"] == 2 and as_expected(result) == want
    assert_clean(redis_server, healthy)


def test_a_prompt_that_fills_the_context_is_the_jobs_error_not_the_engines(
        redis_server: RedisServer, tiny_llama: Path, thread_workers: list[ThreadWorker],
        offline: Callable[..., list[Expected]]) -> None:
    """A prompt of max_model_len tokens leaves no room to generate: admission refuses it as
    limit_exceeded (the client's to fix, a 400 at the gateway), not as the engine's error; one
    token shorter runs, and stops at the context with its one token."""
    context = AutoConfig.from_pretrained(str(tiny_llama)).max_position_embeddings
    client = Client(redis_server.url)
    params = {"temperature": 0, "max_tokens": 4}
    full = client.submit([5] * context, params, model="tiny")
    fits = client.submit([5] * (context - 1), params, model="tiny")
    tw = ThreadWorker(redis_server, tiny_llama, "inproc")
    thread_workers.append(tw)
    with pytest.raises(JobError) as exc:
        full.result(timeout=60)
    assert (exc.value.code, exc.value.message) == (
        "limit_exceeded", f"prompt has {context} tokens, over the cap of {context - 1} "
        f"(max_model_len {context} leaves room for one generated token)")
    result = fits.result(timeout=60)
    assert [(len(o["token_ids"]), o["finish_reason"]) for o in result["outputs"]] == [
        (1, "length")]
    assert as_expected(result) == offline([[5] * (context - 1)], params)[0]
    assert tw.worker.counters["engine_failures"] == 0
    assert_clean(redis_server, tw)


def test_a_job_with_a_stop_token_outside_the_vocabulary_is_refused_by_a_genq_worker(
        redis_server: RedisServer, tiny_llama: Path, workers: WorkerFactory,
        offline: Callable[..., list[Expected]]) -> None:
    """The real job that made step() raise (found while building the quarantine): min_tokens with
    a stop token id outside the vocabulary, which the sampler banned by indexing the logits with
    it. It killed every worker that ran it; now admission refuses it as invalid_params (the engine
    would too, when it is added), and the jobs read with it complete."""
    bad: dict[str, Any] = {"temperature": 0, "max_tokens": 6, "min_tokens": 2,
                           "stop_token_ids": [1_000_000]}
    good = GOOD[:3]
    expected = offline([p for p, _ in good], [params for _, params in good])
    jobs = submit(redis_server, [good[0], ("a poisoned job", bad), good[1], good[2]])
    proc = workers.start(redis_server.url, tiny_llama, "real", "--max-num-seqs", "8")
    wait_heartbeats(redis_server, [proc])
    with pytest.raises(JobError) as exc:
        jobs[1].result(timeout=60)
    vocab = AutoConfig.from_pretrained(str(tiny_llama)).vocab_size
    assert (exc.value.code, exc.value.message) == (
        "invalid_params", f"stop_token_ids holds 1000000, outside the vocabulary [0, {vocab})")
    for job, want in zip([jobs[0], jobs[2], jobs[3]], expected, strict=True):
        result = job.result(timeout=60)
        assert as_expected(result) == want
        assert_streamed_once(redis_server, job, result)
    conn = redis_server.client()
    wait_for(lambda: conn.xpending(KEYS.jobs("tiny"), "workers")["pending"] == 0, timeout=10,
             what="every entry acked")
    assert conn.xlen(KEYS.dead("tiny")) == 0 and proc.alive()

    def idle() -> dict[str, Any] | None:
        beat = conn.get(KEYS.worker("tiny", "real"))
        info = decode_heartbeat(beat) if isinstance(beat, bytes) else None
        return info if info and info["held"] == 0 and info["completed"] == 3 else None

    info = wait_for(idle, timeout=15, what="an idle heartbeat")
    assert info is not None
    assert info["num_free_blocks"] == info["num_total_blocks"]
    assert (info["engine_failures"], info["culprits"], info["rejected"]) == (0, 0, 1)
    assert proc.terminate() == 0


def test_a_job_whose_events_cannot_be_built_ends_with_engine_error_and_the_others_complete(
        redis_server: RedisServer, tiny_llama: Path, thread_workers: list[ThreadWorker],
        offline: Callable[..., list[Expected]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The step is fine but turning one job's output into events raises (in the worker, after
    the engine): that job ends with engine_error, its terminal event last in its stream."""
    import worker.held

    real = worker.held.token_events

    def failing(job: Any, output: Any) -> Any:
        if job.spec.params.get("seed") == MARK and sum(map(len, job.token_ids.values())) >= 3:
            raise ZeroDivisionError("no events for this one")
        return real(job, output)

    monkeypatch.setattr(worker.held, "token_events", failing)
    good = GOOD[:3]
    expected = offline([p for p, _ in good], [params for _, params in good])
    jobs = submit(redis_server, [good[0], poisoned(MARK), good[1], good[2]])
    tw = ThreadWorker(redis_server, tiny_llama, "inproc")
    thread_workers.append(tw)
    error = engine_error(jobs[1])
    assert error.message == ("the worker failed on this job's output: ZeroDivisionError: no "
                             "events for this one")
    raw = reply_events(redis_server, jobs[1].id)
    kinds = [e["type"] for e in raw]  # (the writer may merge steps' tokens into one event)
    assert kinds[0] == "started" and kinds[-1] == "error" and set(kinds[1:-1]) == {"tokens"}
    assert sum(len(e["token_ids"]) for e in raw if e["type"] == "tokens") == 3
    for job, want in zip([jobs[0], jobs[2], jobs[3]], expected, strict=True):
        result = job.result(timeout=60)
        assert as_expected(result) == want
        assert_streamed_once(redis_server, job, result)
    assert tw.worker.counters["engine_failures"] == 0
    assert_clean(redis_server, tw)
    assert tw.stop() == 0
