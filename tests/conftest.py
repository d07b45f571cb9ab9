from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.tiny_models import ARCHS, build_model, build_tokenizer

if TYPE_CHECKING:
    from tests.fleet.harness import RedisServer

# The fleet harness imports redis, which a lent GPU machine lacks (it has torch, cupy,
# transformers, numpy and pytest only): it is imported where a test asks for Redis, so that
# `pytest -m gpu tests/gpu` collects there.
_HARNESS = "tests.fleet.harness"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failing test shows the tail of every live worker's log (tmp dirs get rotated)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    harness = sys.modules.get(_HARNESS)  # no harness imported: no workers were started
    if report.when == "call" and report.failed and harness is not None:
        for title, text in harness.WorkerFactory.log_tails():
            report.sections.append((title, text))


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server of the test's own, on a free port (fault tests kill and restart it)."""
    from tests.fleet.harness import RedisServer

    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    """Every tiny architecture, built once per session: {arch: model directory}."""
    root = tmp_path_factory.mktemp("models")
    return {arch: build_model(arch, root / arch, tokenizer_dir) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]
