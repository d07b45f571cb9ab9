"""A live OpenAI gateway process over a real redis-server and real workers, the demo model with a
chat template, and what the ecosystem tests read a stream with."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.harness.fleet import RedisServer, WorkerFactory, free_port, wait_for, wait_heartbeats

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "models" / "genq-tiny-stdlib"
PROMPT = "def main("
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\ndef{% endif %}")
CHAT = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def main("}]


def chat_model(path: Path) -> Path:
    """The demo model copied to `path`, with TEMPLATE as its chat template."""
    shutil.copytree(MODEL_DIR, path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    return path


class GatewayProcess:
    def __init__(self, redis_url: str, log: Path, *extra: str) -> None:
        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "producer.cli", "gateway", "--redis", redis_url,
                 "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
                 *extra], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.log = log

        def up() -> bool:
            assert self.proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, timeout=60, interval=0.1, what="the gateway")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                             timeout=120)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def gateway_fleet(tmp: Path, workers: list[tuple[Path, str, str]],
                  *gateway_args: str) -> Iterator[tuple[RedisServer, GatewayProcess]]:
    """redis-server, one worker per (model dir, worker name, served name), and a gateway."""
    server = RedisServer(tmp)
    server.start()
    factory = WorkerFactory(tmp)
    gateway = None
    try:
        procs = [factory.start(server.url, model, name, served_name=served)
                 for model, name, served in workers]
        gateway = GatewayProcess(server.url, tmp / "gateway.log", *gateway_args)
        wait_heartbeats(server, procs)
        yield server, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        factory.stop_all()
        server.kill()


def sse(gateway: GatewayProcess, body: dict[str, Any], headers: dict[str, str] | None = None,
        route: str = "/v1/completions") -> list[tuple[str | None, Any]]:
    """(event id, data) for each server-sent event of a streamed completion (or chat), asked
    for with the opt-in to `id:` lines (Genq-Resumable) that a later resume needs."""
    events: list[tuple[str | None, Any]] = []
    with httpx.stream("POST", f"{gateway.url}{route}", json={**body, "stream": True},
                      headers={"Genq-Resumable": "1", **(headers or {})}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        event_id = None
        for line in resp.iter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                data = line[6:]
                events.append((event_id, data if data == "[DONE]" else json.loads(data)))
                event_id = None
    return events


def entry_key(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)
