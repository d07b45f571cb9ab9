"""Fleet fixtures: a real redis-server per test and real worker processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fleet.harness import RedisServer, WorkerFactory


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[WorkerFactory]:
    factory = WorkerFactory(tmp_path)
    yield factory
    factory.stop_all()
