"""The writer process: the writer (worker/io_thread.py) in a child process of its own, so its
per-event Python work runs on another core instead of taking turns with the engine's thread for
the GIL. It is the worker's default (--writer process); --writer thread keeps it in-process.
Where the engine's own CPU per token is small (a GPU's, or a small model's), the writer's
per-event work is what bounds a worker's streaming, so it gets a core of its own; where the
forward pass dominates, either is as fast (docs/benchmarks.md has the figures).

WriterProcess, on the worker's side, has the writer thread's interface (submit, backlog, flush,
check, stop, the `lost` and `finished` queues). The child's feedback is read when the loop asks
(backlog, check, flush: non-blocking reads of the pipe), not by a thread: a thread woken by
every write's feedback would take the GIL from the engine's thread at each step. Likewise a submit
never blocks: what the pipe to the child cannot take now waits in the worker and goes in as the
child reads (so a worker stopping while Redis is down, the child stuck retrying, still stops
within its flush timeout however much it hands back).
The child is `python -m worker.writer_process`: it imports redis and msgpack, never torch, and
dies with the worker (PR_SET_PDEATHSIG, and the end of its input).

The pipe (no pickle): frames of a 4-byte little-endian length and a MessagePack body. Worker to
writer: a config map, then one [events, finishes] per batch (EventWrite and FinishWrite are
tuples: one msgpack call per step); an empty frame: write what came before it, then exit.
Writer to worker, after each write: {"n": batches written, "w": events written in all,
"l": [entry id, deliveries] of the attempts lost, "f": entry ids whose finish landed};
{"error": text} before it exits on a bug.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, TypeVar

import msgpack

from producer.connection import connect
from worker.batch import Batch, EventWrite, FinishWrite
from worker.frames import PIPE_BYTES, Frames, frame
from worker.io_thread import Writer
from worker.streams import JobStream

T = TypeVar("T")
log = logging.getLogger("genq.worker")


class WriterProcess:
    def __init__(self, redis_url: str, streams: list[JobStream], group: str, me: str,
                 reply_ttl: int, dead_ttl: int, max_events_per_call: int = 1024,
                 min_replicas: int = 0) -> None:
        self.config = {"redis_url": redis_url, "streams": [list(s) for s in streams],
                       "group": group, "me": me, "reply_ttl": reply_ttl, "dead_ttl": dead_ttl,
                       "max_events_per_call": max_events_per_call,
                       "min_replicas": min_replicas,
                       "log_level": logging.getLogger().getEffectiveLevel()}
        self.lost: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()  # (Writer.lost)
        self.finished: queue.SimpleQueue[str] = queue.SimpleQueue()  # finish writes done
        self.num_events_written = 0  # after coalescing
        self._error: BaseException | None = None
        self._submitted = 0
        self._written = 0
        # The child's feedback is read by whoever asks (poll): no thread of ours wakes at every
        # write to take the GIL from the engine's.
        self._poll_lock = threading.Lock()
        self._send_lock = threading.RLock()  # (_send holds it around _pump)
        # Frames not yet in the pipe: a submit never waits for room in it (the child may be
        # stuck retrying Redis and read nothing for minutes); what waits here goes in as the
        # child reads (poll). The loop's wait on backlog() bounds it, as it bounds the pipe.
        self._out = bytearray()
        self._in_fd = -1
        self._proc: subprocess.Popen[bytes] | None = None
        self._feedback: Frames | None = None
        self._stopping = False

    def start(self) -> None:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[1])  # the child imports this package
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "worker.writer_process", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        with contextlib.suppress(OSError):  # (a smaller pipe only blocks sooner)
            fcntl.fcntl(self._proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self._in_fd = self._proc.stdin.fileno()
        os.set_blocking(self._in_fd, False)  # (a full pipe: the frames wait in _out)
        self._feedback = Frames(self._proc.stdout.fileno())
        self._send(msgpack.packb(self.config))

    @property
    def error(self) -> BaseException | None:
        """Why the child failed (its error, or its exit), as of now; None while it works."""
        self.poll()
        return self._error

    def submit(self, batch: Batch) -> None:
        if not batch:
            return
        self._submitted += 1
        self._send(msgpack.packb([batch.events, batch.finishes]))

    def backlog(self) -> int:
        self.poll()
        return self._submitted - self._written

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is written; False if `timeout` ran out."""
        end = None if timeout is None else time.monotonic() + timeout
        self.poll()
        while self._written < self._submitted and self._error is None:
            left = 0.05 if end is None else end - time.monotonic()
            if left <= 0:
                return False
            self.poll(min(left, 0.05))
        self.check()
        return True

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError("the writer process failed; stopping the worker") from self._error

    def stop(self, timeout: float = 30.0) -> None:
        """Write what was submitted (up to `timeout`), then end the child."""
        proc = self._proc
        if proc is None:
            return
        self._stopping = True
        end = time.monotonic() + timeout
        with contextlib.suppress(OSError):
            self._send(b"")
            while self._out and self._feedback is not None and time.monotonic() < end:
                self.poll(min(0.05, max(end - time.monotonic(), 0)))
            assert proc.stdin is not None
            proc.stdin.close()
        while self._feedback is not None and time.monotonic() < end:  # its last feedback
            self.poll(min(0.05, max(end - time.monotonic(), 0)))
        try:
            proc.wait(max(end - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            log.warning("the writer process did not stop within %.0f s; killing it", timeout)
            self.abandon()

    def abandon(self) -> None:
        """End the child now, whatever it still holds (Redis would not take it)."""
        self._stopping = True
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def poll(self, timeout: float = 0.0) -> None:
        """Take in the child's feedback: what it has sent by now, waiting up to `timeout` for
        some if none is there."""
        with self._poll_lock:
            frames = self._feedback
            if frames is None:
                return
            if timeout > 0:
                self._wait(frames, timeout)
            if self._out:
                self._pump()
            batch = frames.take_ready()
            if batch is None:  # the end of its output: it exited
                self._feedback = None
                assert self._proc is not None
                code = self._proc.wait()
                if not self._stopping:
                    self._fail(RuntimeError(f"the writer process exited with status {code}"))
                return
            for frame in batch:
                self._take(msgpack.unpackb(frame))

    def _take(self, msg: dict[str, Any]) -> None:
        if "error" in msg:
            self._fail(RuntimeError(f"the writer process failed: {msg['error']}"))
            return
        for entry_id, deliveries in msg["l"]:
            self.lost.put((entry_id, deliveries))
        for entry_id in msg["f"]:
            self.finished.put(entry_id)
        self._written += msg["n"]
        self.num_events_written = msg["w"]

    def _send(self, payload: bytes) -> None:
        """Queue one frame for the child and put what the pipe takes in it now."""
        with self._send_lock:
            self._out += frame(payload)
            self._pump()

    def _pump(self) -> None:
        """Write what waits in _out while the pipe to the child has room (never blocks)."""
        with self._send_lock:
            out = self._out
            try:
                while out:
                    del out[:os.write(self._in_fd, out)]
            except BlockingIOError:
                pass  # full: the rest goes in as the child reads (poll)
            except OSError as exc:  # the child is gone; its exit is reported by the feedback
                out.clear()
                self._fail(RuntimeError(f"the writer process does not take writes: {exc}"))

    def _wait(self, frames: Frames, timeout: float) -> None:
        """Wait up to `timeout` for feedback, or for room in the pipe while frames wait."""
        waiter = select.poll()  # (poll, not select: any fd number)
        waiter.register(frames.fd, select.POLLIN)
        if self._out:
            waiter.register(self._in_fd, select.POLLOUT)
        waiter.poll(timeout * 1000)

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc


def _die_with_parent(parent: int) -> None:
    with contextlib.suppress(OSError, AttributeError):  # Linux: SIGKILL when the worker dies
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os._exit(0)


def _decode(frame: bytes) -> Batch:
    events, finishes = msgpack.unpackb(frame)
    return Batch(events=[EventWrite(*e) for e in events],
                 finishes=[FinishWrite(*f) for f in finishes])


def main(argv: list[str]) -> int:
    for signum in (signal.SIGINT, signal.SIGTERM):  # the worker decides when its writer stops
        signal.signal(signum, signal.SIG_IGN)
    _die_with_parent(int(argv[0]))
    out = os.dup(1)  # the feedback pipe; stray prints go to stderr instead
    os.dup2(2, 1)
    frames = Frames(0)
    first = frames.take()
    if not first:
        return 0
    config: dict[str, Any] = msgpack.unpackb(first[0])
    logging.basicConfig(level=config["log_level"], stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s(writer): %(message)s")
    conn = connect(config["redis_url"], socket_timeout=10)
    writer = Writer(conn, [JobStream(*s) for s in config["streams"]], config["group"],
                    config["me"], config["reply_ttl"], config["dead_ttl"],
                    config["max_events_per_call"],  # driven from here, not started as a thread
                    config["min_replicas"])

    def send(msg: dict[str, Any]) -> None:
        data = memoryview(frame(msgpack.packb(msg)))
        while data:
            data = data[os.write(out, data):]

    pending = first[1:]
    try:
        while True:
            raw = pending or frames.take()
            pending = []
            if not raw:
                return 0  # the worker is gone without a word: nothing here is wanted
            stop = b"" in raw
            raw = raw[:raw.index(b"")] if stop else raw
            writer.write_batches([_decode(f) for f in raw])
            send({"n": len(raw), "w": writer.num_events_written,
                  "l": _drain(writer.lost), "f": _drain(writer.finished)})
            if stop:
                return 0
    except BaseException as exc:
        log.exception("the writer process failed")
        with contextlib.suppress(OSError):
            send({"error": f"{type(exc).__name__}: {exc}"[:2000]})
        return 1


def _drain(q: queue.SimpleQueue[T]) -> list[T]:
    out: list[T] = []
    while not q.empty():
        out.append(q.get())
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
