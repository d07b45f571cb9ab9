"""`genq celery-bridge`: a real Celery app (Redis broker and result backend, json or msgpack,
never pickle) calls genq.generate on the same redis-server a live genq worker serves."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeoutError

from producer.lanes import lane_key
from producer.protocol import Keys
from tests.harness.fleet import RedisServer, WorkerFactory, wait_for, wait_heartbeats
from tests.harness.oracle import Oracle

REPO = Path(__file__).resolve().parents[2]
PROMPT = "hello world"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("celery")
    server = RedisServer(tmp)
    server.start()
    workers = WorkerFactory(tmp)
    bridge = None
    try:
        worker = workers.start(server.url, tiny_llama, "celery-worker")
        bridge = start_bridge(server.url, tmp / "bridge.log")
        wait_heartbeats(server, [worker])
        yield server.url
    finally:
        if bridge is not None:
            stop(bridge)
        workers.stop_all()
        server.kill()


@pytest.fixture(autouse=True)
def collect_results() -> Iterator[None]:
    """AsyncResult.__del__ unsubscribes from the result backend: let it run while Redis lives
    (results caught in pytest.raises tracebacks sit in reference cycles until a collection)."""
    yield
    gc.collect()


def start_bridge(url: str, log: Path, *extra: str,
                 queue: str = "celery") -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        bridge = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "celery-bridge", "--broker", url, "--redis", url,
             "--concurrency", "8", "--loglevel", "WARNING", "--queue", queue, *extra],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
            stderr=subprocess.STDOUT)
    conn = redis.Redis.from_url(url)  # up once its consumer has declared the queue
    try:
        wait_for(lambda: bridge.poll() is None and conn.exists(f"_kombu.binding.{queue}"),
                 timeout=60, what="the bridge to declare its queue")
    except AssertionError:
        stop(bridge)
        raise AssertionError(log.read_text(errors="replace")) from None
    return bridge


def stop(bridge: subprocess.Popen[bytes]) -> None:
    bridge.send_signal(signal.SIGTERM)
    try:
        bridge.wait(15)
    except subprocess.TimeoutExpired:
        bridge.kill()
        bridge.wait()


def celery_app(url: str, serializer: str) -> Celery:
    """An app sending its tasks in `serializer`; results come back in the bridge's (json)."""
    app = Celery("app", broker=url, backend=url)
    app.conf.update(task_serializer=serializer, accept_content=["json", "msgpack"],
                    result_accept_content=["json", "msgpack"])
    return app


@pytest.fixture(scope="module")
def offline_pairs(offline: Oracle) -> Callable[[str | list[int], dict[str, Any]],
                                               list[tuple[list[int], str]]]:
    """One prompt's (token_ids, text) per sequence, from the oracle."""
    return lambda prompt, params: [(ids, text) for ids, text, _ in offline([prompt], params)[0]]


@pytest.mark.parametrize("serializer", ["json", "msgpack"])
def test_get_returns_the_same_dict_as_job_result(redis_url: str, serializer: str,
                                                 offline_pairs: Any) -> None:
    from producer import Client

    params = {"temperature": 0, "max_tokens": 8}
    result = celery_app(redis_url, serializer).send_task(
        "genq.generate", kwargs={"prompt": PROMPT, "model": "tiny", "params": params})
    got = result.get(timeout=60)
    with Client(redis_url) as genq:  # the genq job id is the Celery task id
        assert got == genq.job(result.id, "tiny").result(timeout=5)
    assert [(o["token_ids"], o["text"]) for o in got["outputs"]] == offline_pairs(PROMPT, params)


def test_token_id_prompts_and_seeded_n2_jobs_in_parallel_equal_the_offline_engine(
        redis_url: str, offline_pairs: Any) -> None:
    app = celery_app(redis_url, "json")
    cases: list[tuple[str | list[int], dict[str, Any]]] = [
        ([5, 6, 7, 8], {"temperature": 0, "max_tokens": 6}),
        *[(PROMPT, {"n": 2, "temperature": 0.8, "seed": s, "max_tokens": 5}) for s in range(6)],
    ]
    results = [app.send_task("genq.generate",
                             kwargs={"prompt": prompt, "model": "tiny", "params": params})
               for prompt, params in cases]
    for (prompt, params), result in zip(cases, results, strict=True):
        got = result.get(timeout=120)
        assert [(o["token_ids"], o["text"]) for o in got["outputs"]] == offline_pairs(prompt,
                                                                                      params)


def test_a_failed_job_raises_in_get_with_the_jobs_message(redis_url: str) -> None:
    app = celery_app(redis_url, "json")
    result = app.send_task("genq.generate",
                           kwargs={"prompt": PROMPT, "model": "tiny", "params": {"top_k": -5}})
    with pytest.raises(Exception,
                       match=r"top_k must be -1 or 0 \(disable\) or at least 1, got -5"):
        result.get(timeout=60)
    assert result.state == "FAILURE"

    rejected = app.send_task("genq.generate",
                             kwargs={"prompt": PROMPT, "model": "tiny", "params": {"foo": 1}})
    with pytest.raises(Exception, match="unknown sampling parameter\\(s\\): foo"):
        rejected.get(timeout=60)


def test_the_bridge_refuses_pickled_tasks(redis_url: str) -> None:
    app = Celery("app", broker=redis_url, backend=redis_url)
    app.conf.update(task_serializer="pickle", accept_content=["pickle", "json"],
                    result_accept_content=["json", "msgpack"])
    result = app.send_task("genq.generate", kwargs={"prompt": PROMPT, "model": "tiny"})
    with pytest.raises(CeleryTimeoutError):  # refused unread: no result ever comes
        result.get(timeout=3)
    assert result.state == "PENDING"
    # The same task as json, sent after it, runs: the bridge was consuming all along; the
    # pickled one never became a genq job (no idempotency key under its task id).
    ok = celery_app(redis_url, "json").send_task(
        "genq.generate", kwargs={"prompt": PROMPT, "model": "tiny",
                                 "params": {"temperature": 0, "max_tokens": 2}})
    assert len(ok.get(timeout=120)["outputs"][0]["token_ids"]) == 2
    conn = redis.Redis.from_url(redis_url)
    assert conn.exists(Keys().idem(ok.id, "tiny")) == 1
    assert conn.exists(Keys().idem(result.id, "tiny")) == 0


def test_a_task_whose_bridge_died_is_delivered_again_and_attaches_to_the_running_job(
        redis_url: str, tmp_path: Path) -> None:
    from producer import Client
    from producer.events import decode_event

    extra = ("--visibility-timeout", "2")
    bridge = start_bridge(redis_url, tmp_path / "first.log", *extra, queue="crash")
    params = {"temperature": 0, "max_tokens": 480, "ignore_eos": True}
    result = celery_app(redis_url, "json").send_task(
        "genq.generate", kwargs={"prompt": PROMPT, "model": "tiny", "params": params},
        queue="crash")
    conn = redis.Redis.from_url(redis_url)
    wait_for(lambda: conn.exists(Keys().reply(result.id, "tiny")), timeout=60,
             what="the job to start")
    bridge.kill()  # kill -9 while its thread waits on the job: the task is unacked
    bridge.wait()
    second = start_bridge(redis_url, tmp_path / "second.log", *extra, queue="crash")
    try:
        got = result.get(timeout=120)
    finally:
        stop(second)
    with Client(redis_url) as genq:
        assert got == genq.job(result.id, "tiny").result(timeout=5)
    events = [decode_event(f[b"e"]) for _, f in conn.xrange(Keys().reply(result.id, "tiny"))]
    assert [e["type"] for e in events].count("started") == 1  # the job ran once
    assert got["usage"]["completion_tokens"] == 480


def test_a_task_that_times_out_cancels_its_job_and_gave_it_a_deadline(redis_url: str,
                                                                       tmp_path: Path) -> None:
    """Past the bridge's --timeout nobody reads the result: the job carries that deadline (a
    worker will not start it later) and is cancelled, as the gateway does. Celery's priority
    option is the job's priority."""
    import time

    from producer.protocol import decode_job_entry

    bridge = start_bridge(redis_url, tmp_path / "bridge.log", "--timeout", "1", queue="slow")
    try:
        sent = time.time()
        result = celery_app(redis_url, "json").send_task(
            "genq.generate", kwargs={"prompt": PROMPT, "model": "nobody-serves-this"},
            queue="slow", priority=3)
        with pytest.raises(Exception, match="no terminal event within 1.0 s; the job was "
                                            "cancelled"):
            result.get(timeout=60)
    finally:
        stop(bridge)
    conn, keys = redis.Redis.from_url(redis_url), Keys()
    [(_, fields)] = conn.xrange(lane_key(keys, "nobody-serves-this", 2))  # (the low lane)
    spec, _ = decode_job_entry(fields)
    assert spec.id == result.id and spec.deadline is not None and spec.priority == 3
    assert sent < spec.deadline < sent + 1 + 30  # submitted at most 30 s after sending
    assert conn.exists(keys.cancel(result.id, "nobody-serves-this")) == 1
