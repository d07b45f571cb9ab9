"""The writer process (worker/writer_process.py) against a real redis-server: the same writes,
fencing and feedback as the writer thread, through a pipe; its death is the worker's error, and
the worker's death is its end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from producer.events import encode_event, error_event, started_event, tokens_event
from producer.protocol import Keys
from tests.harness.fleet import REPO, RedisServer, wait_for
from tests.harness.writer import JOBS, STREAMS, events_of, setup_group
from worker.batch import Batch, EventWrite, FinishWrite
from worker.frames import Frames
from worker.io_thread import Writer
from worker.writer_process import WriterProcess

KEYS = Keys(model="m")  # (the jobs of the replies here: model m's)


def drain(q: object) -> list[str]:
    out = []
    while not q.empty():  # type: ignore[attr-defined]
        out.append(q.get())  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_writes_fencing_and_feedback_are_the_threads(redis_server: RedisServer,
                                                     kind: str) -> None:
    mine, stolen = setup_group(redis_server, "me", 2)
    conn = redis_server.client()
    conn.xclaim(JOBS, "workers", "thief", 0, [stolen])
    args = (STREAMS, "workers", "me", 60, 60)
    writer = WriterProcess(redis_server.url, *args) if kind == "process" else Writer(conn, *args)
    writer.start()
    writer.submit(Batch(events=[EventWrite(mine, 1, KEYS.reply("j0"), [started_event(1, "me")]),
                                EventWrite(stolen, 1, KEYS.reply("j1"),
                                           [started_event(1, "me")])]))
    for pos in range(3):  # steps that may merge in the writer: tokens stay in order
        writer.submit(Batch(events=[EventWrite(mine, 1, KEYS.reply("j0"),
                                               [tokens_event(1, 0, pos, [7 + pos], "x")])]))
    writer.submit(Batch(finishes=[
        FinishWrite(mine, 1, KEYS.reply("j0"), encode_event(error_event(1, "x", "done")),
                    idem_key=KEYS.idem("j0")),
        FinishWrite(stolen, 1, KEYS.reply("j1"), encode_event(error_event(1, "x", "done")))]))
    assert writer.flush(timeout=30) is True
    assert writer.backlog() == 0
    writer.stop()
    assert drain(writer.lost) == [(stolen, 1)]
    assert drain(writer.finished) == [mine, stolen]
    events = events_of(redis_server, "j0")
    kinds = [e["type"] for e in events]  # (1-3 tokens events: steps may have merged)
    assert kinds[0] == "started" and kinds[-1] == "error" and set(kinds[1:-1]) == {"tokens"}
    assert [t for e in events if e["type"] == "tokens" for t in e["token_ids"]] == [7, 8, 9]
    assert events_of(redis_server, "j1") == []
    assert conn.xlen(JOBS) == 1  # the finished entry was acked and deleted, the stolen one not
    # j0's events but its error (a finish), and the stolen entry's start (refused in Lua)
    assert writer.num_events_written == (len(events) - 1) + 1


def test_a_writer_process_that_dies_is_the_workers_error(redis_server: RedisServer) -> None:
    (entry,) = setup_group(redis_server, "me", 1)
    writer = WriterProcess(redis_server.url, STREAMS, "workers", "me", 60, 60)
    writer.start()
    assert writer._proc is not None
    writer._proc.kill()
    wait_for(lambda: writer.error is not None, timeout=10, what="the writer's death noticed")
    with pytest.raises(RuntimeError, match="the writer process failed; stopping the worker") \
            as err:
        writer.check()
    assert str(err.value.__cause__) == "the writer process exited with status -9"
    writer.submit(Batch(events=[EventWrite(entry, 1, KEYS.reply("j0"),
                                           [started_event(1, "me")])]))  # no raise here
    with pytest.raises(RuntimeError, match="the writer process failed; stopping the worker"):
        writer.flush(timeout=5)  # the error, not a hang
    writer.stop()


def test_the_writer_process_ends_with_its_worker(redis_server: RedisServer) -> None:
    """kill -9 of the worker: the child gets SIGKILL too (PR_SET_PDEATHSIG), so nothing writes
    on for a worker that is gone."""
    code = ("import os\n"
            "from worker.streams import JobStream\n"
            "from worker.writer_process import WriterProcess\n"
            f"w = WriterProcess({redis_server.url!r}, [JobStream('genq:jobs:m', 'genq:dead:m', "
            "None)], 'workers', 'me', 60, 60)\n"
            "w.start()\n"
            "print(w._proc.pid, flush=True)\n"
            "os.kill(os.getpid(), 9)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == -9
    child = int(out.stdout.split()[0])
    wait_for(lambda: not alive(child), timeout=10, what="the writer process gone")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_frames_come_whole_however_the_pipe_splits_them() -> None:
    r, w = os.pipe()
    frames = Frames(r)
    header = (3).to_bytes(4, "little")
    os.write(w, header + b"abc" + (5).to_bytes(4, "little") + b"de")
    assert frames.take() == [b"abc"]
    os.write(w, b"fgh" + (0).to_bytes(4, "little"))
    assert frames.take() == [b"defgh", b""]
    os.close(w)
    assert frames.take() == []
    os.close(r)


def test_submits_never_deadlock_on_feedback_the_loop_has_not_read(
        redis_server: RedisServer) -> None:
    """The loop reads the child's feedback only when it asks (backlog, check, flush). Large
    batches submitted back to back fill the pipe to the child while the child's feedback for the
    batches before fills the pipe back: a submit never blocks (what the pipe cannot take waits
    in the worker), and the flush moves both. Every finish lands, in order."""
    import threading

    setup_group(redis_server, "me", 1)
    writer = WriterProcess(redis_server.url, STREAMS, "workers", "me", 60, 60)
    writer.start()
    event = encode_event(error_event(1, "x", "y" * 4000))
    ids = [[f"{b}-{i}" for i in range(100)] for b in range(150)]

    def submit_all() -> None:  # ~60 MB of frames, ~0.5 MB of feedback: no backlog() between
        for batch_ids in ids:
            writer.submit(Batch(finishes=[FinishWrite(eid, 1, KEYS.reply(f"j{eid}"), event)
                                          for eid in batch_ids]))

    sender = threading.Thread(target=submit_all, daemon=True)
    sender.start()
    sender.join(timeout=120)
    assert not sender.is_alive(), "submit() deadlocked against the child's unread feedback"
    assert writer.flush(timeout=60) is True
    writer.stop()
    assert writer.error is None
    assert drain(writer.finished) == [eid for batch_ids in ids for eid in batch_ids]


def test_a_stop_while_redis_is_down_is_bounded_by_the_flush_timeout(
        redis_server: RedisServer) -> None:
    """Redis down, the child stuck retrying its write: a hand-back far larger than the pipe
    (a draining worker's held jobs, payloads and all) is submitted at once, the flush gives up
    at its timeout and the child is ended (the jobs stay pending: reclaimed, nothing lost)."""
    import time

    setup_group(redis_server, "me", 1)
    writer = WriterProcess(redis_server.url, STREAMS, "workers", "me", 60, 60)
    writer.start()
    redis_server.kill()
    writer.submit(Batch(events=[EventWrite("1-1", 1, KEYS.reply("j"),
                                           [started_event(1, "me")])]))
    payload = b"p" * 10_000
    start = time.monotonic()
    writer.submit(Batch(finishes=[FinishWrite(f"2-{i}", 1, None, None,
                                              readd_fields=[b"v", b"1", b"job", payload])
                                  for i in range(400)]))  # 4 MB: four times the pipe
    submitted = time.monotonic() - start
    assert writer.flush(timeout=1.0) is False
    flushed = time.monotonic() - start
    writer.abandon()
    assert submitted < 0.5 and flushed < 2.0, (submitted, flushed)
    assert writer.backlog() == 2 and drain(writer.finished) == []
