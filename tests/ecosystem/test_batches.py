"""The OpenAI Batch API on the gateway, driven by the official openai client over a real
redis-server and worker: results equal the offline engine's, bad lines land in the error file,
a cancel stops the batch, and a gateway killed mid-batch and restarted completes it once."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from producer.events import decode_event
from producer.protocol import REPLY_FIELD, Keys
from tests.harness.fleet import RedisServer, serving_worker, wait_for
from tests.harness.gateway import GatewayProcess
from tests.harness.oracle import Oracle

LONG = 400  # tokens per line of the long batches: the worker (2 at a time) takes seconds


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[
        tuple[RedisServer, Path]]:
    tmp = tmp_path_factory.mktemp("batches")
    server = RedisServer(tmp)
    server.start()
    try:
        for _worker in serving_worker(server, tiny_llama, tmp, "bw", "--max-num-seqs", "2"):
            yield server, tmp / "files"
    finally:
        server.kill()


@pytest.fixture
def gateway(fleet: tuple[RedisServer, Path], tmp_path: Path) -> Iterator[GatewayProcess]:
    server, files = fleet
    gw = GatewayProcess(server.url, tmp_path / "gateway.log", "--files-dir", str(files))
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def offline_texts(offline: Oracle) -> Callable[[list[str], dict[str, Any]], list[str]]:
    """The oracle's text of each prompt's first sequence."""
    return lambda prompts, params: [seqs[0].text for seqs in offline.outputs(prompts, params)]


def upload(client: openai.OpenAI, tmp: Path, lines: list[str]) -> str:
    path = tmp / "batch.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with open(path, "rb") as f:
        return client.files.create(file=f, purpose="batch").id


def request(custom_id: str, prompt: str, **params: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"model": "tiny", "prompt": prompt, **params}})


def wait_status(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...]) -> Any:
    return wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b,
                    timeout=240, interval=0.2, what=f"batch status in {statuses}")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(raw) for raw in client.files.content(file_id).text.splitlines()]


def test_a_batch_completes_with_the_offline_answers_and_an_error_file(
        gateway: GatewayProcess, offline_texts: Any, tmp_path: Path) -> None:
    client = gateway.openai()
    prompts = [f"def f{i}(" for i in range(6)]
    lines = [request(f"r{i}", p, max_tokens=10, temperature=0) for i, p in enumerate(prompts)]
    lines += ["{oops", request("bad", "x", temperature=-1),
              json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                          "body": {"model": "tiny", "messages": []}})]
    file_id = upload(client, tmp_path, lines)
    assert client.files.retrieve(file_id).purpose == "batch"
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                  completion_window="24h")
    assert batch.status == "validating" and batch.input_file_id == file_id
    done = wait_status(client, batch.id, ("completed", "failed"))
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (9, 6, 3)
    out = {o["custom_id"]: o for o in lines_of(client, done.output_file_id)}
    want = offline_texts(prompts, {"max_tokens": 10, "temperature": 0})
    assert {cid: o["response"]["body"]["choices"][0]["text"] for cid, o in out.items()} == \
        {f"r{i}": text for i, text in enumerate(want)}
    errors = lines_of(client, done.error_file_id)
    assert sorted(e["error"]["code"] for e in errors) == ["invalid_json", "invalid_request",
                                                         "invalid_url"]
    assert [b.id for b in client.batches.list(limit=1).data] == [batch.id]
    assert client.files.delete(file_id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)


def long_batch(client: openai.OpenAI, tmp: Path, lines: int, done: int) -> str:
    """A batch of `lines` long lines, once `done` of them are done -> its id."""
    file_id = upload(client, tmp, [request(f"q{i}", f"import os {i}", max_tokens=LONG,
                                           temperature=0, ignore_eos=True)
                                   for i in range(lines)])
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                  completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= done,
             timeout=240, what=f"{done} line(s) done")
    return batch.id


def test_cancelling_a_batch_cancels_its_unfinished_jobs(gateway: GatewayProcess,
                                                        fleet: tuple[RedisServer, Path],
                                                        tmp_path: Path) -> None:
    # q0 runs on the served model; q1..q15 name a model no worker serves, so they wait in its
    # queue and the batch cannot end before the cancel, however fast the worker is.
    client = gateway.openai()
    lines = [request("q0", "import os", max_tokens=4, temperature=0)]
    lines += [request(f"q{i}", f"import os {i}", max_tokens=4, model="nobody")
              for i in range(1, 16)]
    batch_id = client.batches.create(input_file_id=upload(client, tmp_path, lines),
                                     endpoint="/v1/completions", completion_window="24h").id
    wait_for(lambda: client.batches.retrieve(batch_id).request_counts.completed >= 1,
             timeout=240, what="q0 done")
    assert client.batches.cancel(batch_id).status in ("cancelling", "cancelled")
    end = wait_status(client, batch_id, ("cancelled",))
    assert (end.request_counts.completed, end.request_counts.failed) == (1, 0)
    assert [o["custom_id"] for o in lines_of(client, end.output_file_id)] == ["q0"]
    flags = list(fleet[0].client().scan_iter(match="genq:cancel:{nobody}:*"))
    assert len(flags) == 15  # each unfinished line's job was cancelled


def started_events(server: RedisServer, job_id: str) -> int:
    entries = server.client().xrange(Keys().reply(job_id, "tiny"))
    return sum(decode_event(f[REPLY_FIELD.encode()])["type"] == "started" for _i, f in entries)


def test_a_gateway_killed_mid_batch_and_restarted_completes_it_once(
        fleet: tuple[RedisServer, Path], offline_texts: Any, tmp_path: Path) -> None:
    server, files = fleet
    first = GatewayProcess(server.url, tmp_path / "gw1.log", "--files-dir", str(files))
    batch_id = long_batch(first.openai(), tmp_path, 10, 2)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    second = GatewayProcess(server.url, tmp_path / "gw2.log", "--files-dir", str(files))
    try:
        client = second.openai()
        done = wait_status(client, batch_id, ("completed",))
        out = lines_of(client, done.output_file_id)
    finally:
        second.stop()
    assert sorted(o["custom_id"] for o in out) == sorted(f"q{i}" for i in range(10))
    assert done.request_counts.completed == 10 and done.request_counts.failed == 0
    want = offline_texts([f"import os {i}" for i in range(10)],
                   {"max_tokens": LONG, "temperature": 0, "ignore_eos": True})
    for o in out:
        assert o["response"]["body"]["choices"][0]["text"] == want[int(o["custom_id"][1:])]
        assert started_events(server, o["response"]["request_id"]) == 1  # ran once
