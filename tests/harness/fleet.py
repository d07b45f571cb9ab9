"""Fleet harness: a real redis-server (which tests may kill and restart) and real worker
processes (so kill -9 means what it says)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import redis

from producer.protocol import Keys
from tests.harness.oracle import Expected

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def sigint_as_from_a_terminal() -> None:
    """Popen's preexec_fn for a child a test interrupts with SIGINT: a suite started in the
    background without job control passes SIGINT ignored to its children, and a Python started
    so installs no KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A redis-server in its own directory with appendonly + fsync always, so kill -9 loses no
    acknowledged write."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, protocol=2, socket_timeout=10)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--logfile", str(self.dir / "redis.log")], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        self.kill()
        time.sleep(down_s)
        self.start()


class WorkerProcess:
    def __init__(self, proc: subprocess.Popen[bytes], name: str, log: Path,
                 served_name: str = "tiny") -> None:
        self.proc = proc
        self.name = name
        self.log = log
        self.served_name = served_name

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP the worker and its child processes (its writer process), children first: a
        paused machine, with nothing of the worker left running to finish a job meanwhile."""
        for pid in [*self._descendants(), self.pid]:
            os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in [self.pid, *self._descendants()]:
            os.kill(pid, signal.SIGCONT)

    def _descendants(self) -> list[int]:
        found, todo = [], [self.pid]
        while todo:
            for task in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
                try:
                    kids = [int(c) for c in task.read_text().split()]
                except OSError:  # (the task ended)
                    continue
                found += kids
                todo += kids
        return found

    def terminate(self, timeout: float = 30.0) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            return -9

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class WorkerFactory:
    """Starts `genq worker` processes (through the console-script dispatcher)."""

    live: list[WorkerFactory] = []  # so a failing test can show every live worker's log

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.workers: list[WorkerProcess] = []
        WorkerFactory.live.append(self)

    def start(self, redis_url: str, model_dir: Path, name: str, *extra: str,
              served_name: str = "tiny") -> WorkerProcess:
        log = self.tmp / f"worker-{name}-{len(self.workers)}.log"
        args = [sys.executable, "-m", "producer.cli", "worker", "--redis", redis_url,
                "--model", str(model_dir), "--served-model-name", served_name, "--device", "cpu",
                "--name", name, "--num-threads", "1", "--heartbeat-ttl", "2",
                "--reclaim-interval", "0.5", "--result-ttl", "30",
                "--num-gpu-blocks-override", "256", "--swap-space", "0.01", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": str(REPO)}
        with open(log, "wb") as out:
            proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        worker = WorkerProcess(proc, name, log, served_name)
        self.workers.append(worker)
        return worker

    def stop_all(self) -> None:
        for worker in self.workers:
            if worker.alive():
                worker.kill9()
        if self in WorkerFactory.live:
            WorkerFactory.live.remove(self)

    @classmethod
    def log_tails(cls, chars: int = 3000) -> list[tuple[str, str]]:
        return [(f"worker {w.name} (pid {w.pid}, alive={w.alive()}) log", w.output()[-chars:])
                for factory in cls.live for w in factory.workers]


def wait_heartbeats(server: RedisServer, workers: list[WorkerProcess],
                    timeout: float = 180.0) -> None:
    """Until every worker has a heartbeat (model loaded, group joined); fail fast on a crash."""
    conn = server.client()

    def ready() -> bool:
        for w in workers:
            if not w.alive():
                raise AssertionError(f"worker {w.name} exited:\n{w.output()[-3000:]}")
        return all(conn.exists(Keys().worker(w.served_name, w.name)) for w in workers)

    wait_for(ready, timeout=timeout, interval=0.1, what="worker heartbeats")


def serving_worker(server: RedisServer, model: Path, workdir: Path, name: str,
                   *extra: str) -> Iterator[WorkerProcess]:
    """One worker started and heartbeating, stopped at the end: the body of a module's worker
    fixture (`yield from serving_worker(...)`)."""
    factory = WorkerFactory(workdir)
    try:
        proc = factory.start(server.url, model, name, *extra)
        wait_heartbeats(server, [proc])
        yield proc
    finally:
        factory.stop_all()


# A wait's cap bounds a failure, never a claim about speed: every wait_for lasts up to at least
# this long, so a loaded machine makes a test slower, not failed.
MIN_WAIT_S = 120.0


def freeze_when(worker: WorkerProcess, predicate: Callable[[], object], what: str,
                timeout: float = 120) -> None:
    """SIGSTOP `worker` as soon as `predicate` holds (polled every 5 ms): a kill -9 test's jobs
    are then caught mid-stream however fast the host runs them (its writer process may still
    land what the worker had handed it)."""
    wait_for(predicate, timeout=timeout, interval=0.005, what=what)
    worker.proc.send_signal(signal.SIGSTOP)


def blocked_xreads(conn: Any) -> list[int]:
    """The client ids of the XREADs blocked on the server `conn` talks to (CLIENT LIST)."""
    return [c["id"] for c in conn.client_list() if c["cmd"] == "xread" and "b" in c["flags"]]


def wait_for(predicate: Callable[[], T], timeout: float = MIN_WAIT_S, interval: float = 0.05,
             what: str = "condition") -> T:
    """predicate()'s first truthy value, polled every `interval` s; an AssertionError after
    max(timeout, MIN_WAIT_S) s."""
    cap = max(timeout, MIN_WAIT_S)
    end = time.monotonic() + cap
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {cap} s waiting for {what}")


def as_expected(result: dict[str, Any]) -> Expected:
    """A done event's outputs in the oracle's shape."""
    return [(o["token_ids"], o["text"], o["finish_reason"]) for o in result["outputs"]]


def reply_events(server: RedisServer, job_id: str, model: str = "tiny") -> list[dict[str, Any]]:
    """Every raw event in a job's reply stream (all attempts)."""
    from producer.events import decode_event
    from producer.protocol import REPLY_FIELD, Keys

    entries = server.client().xrange(Keys().reply(job_id, model))
    return [decode_event(fields[REPLY_FIELD.encode()]) for _id, fields in entries]


def register_heartbeat(conn: redis.Redis, model: str, name: str, value: bytes,
                       ex: int = 60) -> None:
    """A worker's heartbeat as a worker writes it: the key, and its name in the registry that
    `genq status` and the gateway read (producer/registry.py)."""
    keys = Keys()
    conn.set(keys.worker(model, name), value, ex=ex)
    conn.sadd(keys.workers(model), name)
    conn.sadd(keys.models, model)


def stream_all(jobs: list[Any], timeout: float) -> tuple[dict[str, list[dict[str, Any]]],
                                                         list[threading.Thread]]:
    """Consume every job's Job.stream() in its own thread, as clients would."""
    seen: dict[str, list[dict[str, Any]]] = {job.id: [] for job in jobs}
    threads = [threading.Thread(target=lambda j=job: seen[j.id].extend(j.stream(timeout=timeout)))
               for job in jobs]
    for t in threads:
        t.start()
    return seen, threads


def streamed_tokens(events: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """(positions, token ids) of index 0 as a client saw them."""
    positions: list[int] = []
    tokens: list[int] = []
    for e in events:
        if e["type"] == "tokens" and e["index"] == 0:
            positions += range(e["pos"], e["pos"] + len(e["token_ids"]))
            tokens += e["token_ids"]
    return positions, tokens


def pending_of(server: RedisServer, consumer: str, model: str = "tiny") -> int:
    """Entries of the model's stream delivered to `consumer` and not yet acknowledged."""
    from producer.protocol import Keys

    keys = Keys()
    for c in server.client().xinfo_consumers(keys.jobs(model), keys.group):
        if c["name"] == consumer.encode():
            return int(c["pending"])
    return 0
