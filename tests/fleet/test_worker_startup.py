"""`genq worker` (and the other commands) before it serves: a model it cannot load and a Redis
it cannot reach end in a line a person can act on, never a traceback or a process that ignores
SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.fleet import (
    REPO,
    RedisServer,
    WorkerFactory,
    free_port,
    register_heartbeat,
    wait_for,
)


def test_a_directory_without_a_model_stops_the_worker_with_one_line(
        redis_server: RedisServer, workers: WorkerFactory, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    proc = workers.start(redis_server.url, missing, "nomodel")
    assert proc.proc.wait(timeout=120) == 2
    assert proc.output() == (
        f"genq worker: cannot load '{missing}': '{missing}' is not a Hugging Face model "
        "directory (no config.json)\n")
    assert redis_server.client().keys("genq:*") == []


@pytest.mark.parametrize("flags, error", [
    (["--device", "gpu"], "--device must be cpu, cuda or cuda:<index>, got 'gpu'"),
    (["--block-size", "0"], "block_size must be a power of two up to 256"),
    (["--dtype", "fp16"], "dtype must be one of"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "k": 2}'],
     "speculative_config has unknown key(s) ['k']"),
])
def test_a_bad_engine_option_is_one_line_naming_the_option_not_the_model(
        redis_server: RedisServer, workers: WorkerFactory, tiny_llama: Path, flags: list[str],
        error: str) -> None:
    proc = workers.start(redis_server.url, tiny_llama, "badflag", *flags)
    assert proc.proc.wait(timeout=120) == 2
    out = proc.output()
    assert out.startswith(f"genq worker: {error}") and out.count("\n") == 1, out
    assert "cannot load" not in out and "Traceback" not in out


def test_a_cuda_device_on_a_machine_without_one_is_one_line(
        redis_server: RedisServer, workers: WorkerFactory, tiny_llama: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    proc = workers.start(redis_server.url, tiny_llama, "nocuda", "--device", "cuda:0")
    assert proc.proc.wait(timeout=120) == 2
    assert proc.output() == (
        f"genq worker: --device cuda:0: no CUDA device is usable here (torch "
        f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use --device cpu\n")


def test_sigterm_stops_a_worker_still_waiting_for_redis(workers: WorkerFactory,
                                                        tiny_llama: Path) -> None:
    nobody = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    proc = workers.start(nobody, tiny_llama, "orphan")
    wait_for(lambda: "waiting for Redis" in proc.output(), timeout=120, interval=0.2,
             what="the worker to wait for Redis")
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(timeout=15) == 0
    assert "worker orphan stopped before Redis answered; it held no jobs" in proc.output()


@pytest.mark.parametrize("command", [["submit", "hi", "--model", "m"], ["status"],
                                     ["bench", "--model", "m"]])
def test_a_command_that_cannot_reach_redis_says_so_in_one_line(command: list[str]) -> None:
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "producer.cli", *command, "--redis",
                          f"redis://127.0.0.1:{port}/0"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == (
        f"genq {command[0]}: cannot reach Redis (Error 111 connecting to 127.0.0.1:{port}. "
        "Connection refused.); is redis-server running at the URL given by --redis / "
        "GENQ_REDIS?\n")


@pytest.mark.parametrize("command", [["submit", "hi", "--model", "m"], ["status"],
                                     ["bench", "--model", "m"], ["worker", "--model", "m"],
                                     ["gateway"]])
@pytest.mark.parametrize("flag, value, error", [
    ("--redis", "localhost:6379", "argument --redis: bad Redis URL (?://...): no scheme. Use "
                                  "redis://host:port/db, rediss://..., unix:///path.sock, "
                                  "redis+sentinel://host:port[,host:port]/service_name[/db], or "
                                  "redis+cluster://host:port[,host:port]"),
    ("--prefix", "a b", "argument --prefix: key prefix 'a b' must be 1-128 characters from "
                        "[A-Za-z0-9_.:-]"),
])
def test_a_bad_redis_url_or_prefix_is_a_usage_error_not_a_traceback(
        command: list[str], flag: str, value: str, error: str) -> None:
    out = subprocess.run([sys.executable, "-m", "producer.cli", *command, flag, value],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.splitlines()[-1] == f"genq {command[0]}: error: {error}"


def test_status_counts_only_consumers_whose_worker_is_alive(redis_server: RedisServer) -> None:
    """A dead worker stays a consumer of its group until a reclaim pass deletes it: `genq
    status` counts the consumers with a live heartbeat."""
    from producer.protocol import Keys
    from producer.status import queue_rows

    conn, keys = redis_server.client(), Keys()
    conn.xgroup_create(keys.jobs("m"), keys.group, id="0", mkstream=True)
    for name in ("alive", "gone"):
        conn.xgroup_createconsumer(keys.jobs("m"), keys.group, name)
    conn.set(keys.worker("m", "alive"), b"x", ex=60)
    conn.xadd(keys.jobs("m"), {"v": "2", "job": "x"})
    [row] = queue_rows(conn, keys)
    assert row == {"model": "m", "shard": 0, "lane": "default", "length": 1, "lag": 1, "pending": 0,
                   "dead": 0, "consumers": 1}


@pytest.mark.parametrize("given,expected", [(None, "false"), ("true", "true")])
def test_the_worker_turns_the_tokenizer_thread_pool_off_unless_told(given: str | None,
                                                                    expected: str,
                                                                    tmp_path: Path) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    if given is not None:
        env["TOKENIZERS_PARALLELISM"] = given
    code = ("import os, sys; from worker.main import main; "
            f"rc = main(['--redis', 'redis://127.0.0.1:{free_port()}/0', '--model', "
            f"{str(tmp_path / 'none')!r}]); print(rc, os.environ['TOKENIZERS_PARALLELISM'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout == f"2 {expected}\n", out.stderr


def test_status_shows_each_workers_prefix_cache_hit_rate(redis_server: RedisServer) -> None:
    from producer.protocol import Keys, encode_heartbeat
    from producer.status import worker_rows

    conn, keys = redis_server.client(), Keys()
    beats = {"cached": {"prefix_caching": True, "prefix_cache_hit_rate": 0.254},
             "plain": {"prefix_caching": False, "prefix_cache_hit_rate": 0.0},
             "older": {}}  # a worker of an earlier release says nothing of it
    for name, extra in beats.items():
        register_heartbeat(conn, "m", name, encode_heartbeat({"model": "m", "ts": 0.0, **extra}))
    assert {r["name"]: r["prefix_hits"] for r in worker_rows(conn, keys)} == {
        "cached": "25%", "plain": "off", "older": "off"}


def test_a_second_worker_with_a_name_taken_on_this_host_refuses_to_start(
        redis_server: RedisServer, workers: WorkerFactory, tiny_llama: Path) -> None:
    """Two workers under one --name would each adopt the other's entries as their own
    orphans and run every job twice; a restart after a crash (the old pid gone) is fine."""
    from producer import Client
    from tests.harness.fleet import wait_heartbeats

    first = workers.start(redis_server.url, tiny_llama, "gpu0")
    wait_heartbeats(redis_server, [first])
    second = workers.start(redis_server.url, tiny_llama, "gpu0")
    assert second.proc.wait(timeout=120) == 4
    assert (f"another worker named 'gpu0' is running on this host (pid {first.pid}): two "
            "workers with one name would take each other's jobs; give each its own --name "
            "(e.g. one per GPU)") in second.output()
    assert first.alive()
    first.kill9()  # its heartbeat lives on (TTL), its pid is gone: a restart is no clash
    again = workers.start(redis_server.url, tiny_llama, "gpu0")
    result = Client(redis_server.url).submit("hi", {"temperature": 0, "max_tokens": 3},
                                             model="tiny").result(timeout=120)
    assert len(result["outputs"][0]["token_ids"]) == 3
    assert again.alive() and "another worker" not in again.output()
