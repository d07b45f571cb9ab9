"""Security fixtures: redis-servers with the genq ACL users (one plain, one TLS only), worker
processes connected through them (the offline oracle is tests/conftest.py's `offline`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.fleet import WorkerFactory, WorkerProcess, wait_heartbeats
from tests.harness.secure_redis import Certs, SecureRedis, make_certs


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
