"""Security fixtures: redis-servers with the genq ACL users (one plain, one TLS only), worker
processes connected through them, and the offline oracle for exact outputs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fleet.harness import WorkerFactory, WorkerProcess, wait_heartbeats
from tests.security.secure_redis import Certs, SecureRedis, make_certs

Expected = list[tuple[list[int], str, str | None]]
Oracle = Callable[[list[str], dict[str, Any]], list[Expected]]


@pytest.fixture(scope="session")
def oracle(tiny_llama: Path) -> Oracle:
    """LLM.generate on the same tiny model: [(token_ids, text, finish_reason) per sequence] per
    prompt."""
    from engine import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), num_gpu_blocks_override=256, swap_space=0.01,
              num_threads=1)

    def run(prompts: list[str], params: dict[str, Any]) -> list[Expected]:
        outs = llm.generate(prompts, SamplingParams.from_dict(params), use_tqdm=False)
        return [[(list(c.token_ids), c.text, c.finish_reason)
                 for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]

    return run


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="session")
def tls_fleet(tmp_path_factory: pytest.TempPathFactory, certs: Certs,
              tiny_llama: Path) -> Iterator[tuple[SecureRedis, WorkerProcess]]:
    """A TLS-only redis-server (--port 0, client certificates required) and one worker "tls-w"
    reaching it through a rediss:// URL. The worker connects as the default (admin) user, so
    nothing in ACL stands between it and any key: what it writes is what its code writes."""
    tmp = tmp_path_factory.mktemp("tls")
    server = SecureRedis(tmp, certs)
    server.start()
    factory = WorkerFactory(tmp)
    try:
        worker = factory.start(server.url, tiny_llama, "tls-w", "--max-num-seqs", "8")
        wait_heartbeats(server, [worker], timeout=180)  # type: ignore[arg-type]
        yield server, worker
    finally:
        factory.stop_all()
        server.kill()
