"""Fleet fixtures: a real redis-server per test and real worker processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.fleet import RedisServer, WorkerFactory


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server shared by a module's tests (with its module-scoped worker fixture)."""
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    srv.start()
    yield srv
    srv.kill()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[WorkerFactory]:
    factory = WorkerFactory(tmp_path)
    yield factory
    factory.stop_all()



@pytest.fixture(scope="session")
def long_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama with room for 4096 positions (default rope: the same outputs as tiny_llama
    within its 512), so a job can outlast a heartbeat TTL however fast the engine is."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("long") / "llama"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (path / "config.json").write_text(json.dumps(config))
    return path
