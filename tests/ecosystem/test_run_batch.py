"""`genq run-batch`: OpenAI batch files through a real redis-server and worker; each output line
equals the offline engine's answer, bad lines get error lines, and a killed or interrupted run
resumes without running anything twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.events import decode_event
from producer.protocol import REPLY_FIELD, Keys
from tests.harness.fleet import RedisServer, serving_worker, sigint_as_from_a_terminal, wait_for
from tests.harness.oracle import Oracle

REPO = Path(__file__).resolve().parents[2]
WORDS = ["the quick brown fox", "def main(", "import os", "hello world", "a b c", "for i in"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[RedisServer]:
    tmp = tmp_path_factory.mktemp("run-batch")
    server = RedisServer(tmp)
    server.start()
    try:  # (the worker runs two jobs at a time: a long batch takes seconds)
        for _worker in serving_worker(server, tiny_llama, tmp, "rb", "--max-num-seqs", "2"):
            yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def offline_texts(offline: Oracle) -> Any:
    """One prompt's [(text, finish_reason)] from the oracle, or for a list of prompts a list of
    those."""
    def run(prompt: str | list[str], params: dict[str, Any]) -> Any:
        prompts = [prompt] if isinstance(prompt, str) else prompt
        outs = [[(text, reason) for _ids, text, reason in seqs]
                for seqs in offline(list(prompts), params)]
        return outs[0] if isinstance(prompt, str) else outs

    return run


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def start(server: RedisServer, inp: Path, out: Path) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "producer.cli", "run-batch", "-i", str(inp), "-o", str(out),
            "--redis", server.url, "--no-progress"]
    return subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=sigint_as_from_a_terminal)


def run_batch(server: RedisServer, inp: Path, out: Path) -> None:
    proc = start(server, inp, out)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()


def started_with(server: RedisServer, inp: Path, out: Path,
                 lines: int) -> subprocess.Popen[bytes]:
    """run-batch in the background, once it has written `lines` output lines."""
    proc = start(server, inp, out)
    wait_for(lambda: out.exists() and len(out.read_text().splitlines()) >= lines, timeout=120,
             what=f"{lines} line(s) written")
    return proc


def read_out(path: Path) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in path.read_text().splitlines()]


def test_each_line_equals_the_offline_engine_and_bad_lines_say_why(
        fleet: RedisServer, offline_texts: Any, tmp_path: Path) -> None:
    greedy = {"model": "tiny", "max_tokens": 12, "temperature": 0}
    seeded = {"model": "tiny", "max_tokens": 12, "temperature": 0.9, "seed": 7, "n": 2}
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([
        line("a", {**greedy, "prompt": WORDS[0]}),
        "{not json",
        line("b", {**seeded, "prompt": WORDS[1]}),
        line("c", {**greedy, "prompt": [WORDS[2], WORDS[3]]}),
        line("d", {**greedy, "prompt": WORDS[4]}, url="/v1/embeddings"),
        line("e", {**greedy, "prompt": WORDS[4], "temperature": -1}),
        line("a", {**greedy, "prompt": WORDS[5]}),
        line("f", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
             url="/v1/chat/completions"),
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    run_batch(fleet, inp, out)
    got = read_out(out)
    assert [o["custom_id"] for o in got] == ["a", None, "b", "c", "d", "e", "a", "f"]
    ok = {o["custom_id"]: o["response"] for o in got if o["error"] is None
          and o["response"]["status_code"] == 200}
    assert sorted(ok) == ["a", "b", "c"]
    texts = {cid: [(c["text"], c["finish_reason"]) for c in r["body"]["choices"]]
             for cid, r in ok.items()}
    assert texts["a"] == offline_texts(WORDS[0], {"max_tokens": 12, "temperature": 0})
    assert texts["b"] == offline_texts(WORDS[1], {"max_tokens": 12, "temperature": 0.9, "seed": 7,
                                            "n": 2})
    assert texts["c"] == offline_texts(WORDS[2], {"max_tokens": 12, "temperature": 0}) + \
        offline_texts(WORDS[3], {"max_tokens": 12, "temperature": 0})
    assert ok["c"]["body"]["usage"]["completion_tokens"] == 24
    errors = {o["custom_id"]: o["error"] for o in got if o["error"] is not None}
    assert errors[None]["code"] == "invalid_json"
    assert errors["d"]["code"] == "invalid_url" and "/v1/embeddings" in errors["d"]["message"]
    assert errors["e"]["code"] == "invalid_request" and "temperature" in errors["e"]["message"]
    assert [o["error"]["code"] for o in got[6:7]] == ["duplicate_custom_id"]
    chat = got[7]["response"]  # the tiny model has no chat template: the gateway's 400
    assert (chat["status_code"], chat["body"]["error"]["code"]) == (400, "no_chat_template")


def started_events(server: RedisServer, job_id: str) -> int:
    entries = server.client().xrange(Keys().reply(job_id, "tiny"))
    return sum(decode_event(f[REPLY_FIELD.encode()])["type"] == "started" for _i, f in entries)


LONG = 400  # tokens per line: the worker (2 at a time) takes seconds over a batch


def long_batch(tmp_path: Path, lines: int) -> Path:
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(line(f"q{i}", {"model": "tiny", "prompt": WORDS[i % 6] + f" {i}",
                                          "max_tokens": LONG, "temperature": 0,
                                          "ignore_eos": True}) + "\n" for i in range(lines)))
    return inp


def test_a_killed_run_resumes_and_runs_nothing_twice(fleet: RedisServer, offline_texts: Any,
                                                     tmp_path: Path) -> None:
    inp, out = long_batch(tmp_path, 10), tmp_path / "out.jsonl"
    proc = started_with(fleet, inp, out, 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(read_out(out)) < 10
    run_batch(fleet, inp, out)
    got = read_out(out)
    assert sorted(o["custom_id"] for o in got) == sorted(f"q{i}" for i in range(10))
    want = offline_texts([WORDS[i % 6] + f" {i}" for i in range(10)],
                   {"max_tokens": LONG, "temperature": 0, "ignore_eos": True})
    for o in got:
        [(text, _)] = want[int(o["custom_id"][1:])]
        assert o["response"]["body"]["choices"][0]["text"] == text
        assert started_events(fleet, o["response"]["request_id"]) == 1  # ran once


def test_ctrl_c_cancels_what_it_waits_for_and_a_rerun_completes(fleet: RedisServer,
                                                                 tmp_path: Path) -> None:
    inp, out = long_batch(tmp_path, 16), tmp_path / "out.jsonl"
    proc = started_with(fleet, inp, out, 1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert "cancelled. Run the same command again to resume." in err.decode()
    first = read_out(out)
    run_batch(fleet, inp, out)
    got = read_out(out)
    assert sorted(o["custom_id"] for o in got) == sorted(f"q{i}" for i in range(16))
    assert all(o["response"]["status_code"] == 200 for o in got)
    rerun = [o["response"]["request_id"] for o in got[len(first):]]
    assert any(rid.endswith("-r1") for rid in rerun)  # cancelled jobs ran again, new ids
