from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.harness.models import ARCHS, build_model, build_tokenizer

if TYPE_CHECKING:
    from tests.harness.fleet import RedisServer
    from tests.harness.oracle import Oracle, OracleOf

# The fleet harness imports redis, which a lent GPU machine lacks (it has torch, cupy,
# transformers, numpy and pytest only): it is imported where a test asks for Redis, so that
# `pytest -m gpu tests/gpu` collects there.
_HARNESS = "tests.harness.fleet"


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
    from tests.harness.fleet import RedisServer

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


@pytest.fixture(scope="session")
def oracle_of() -> OracleOf:
    """The offline oracle of a model directory, built once per model per session."""
    from tests.harness.oracle import Oracle

    built: dict[Path, Oracle] = {}

    def of(model: Path) -> Oracle:
        if model not in built:
            built[model] = Oracle(model)
        return built[model]

    return of


@pytest.fixture(scope="session")
def offline(oracle_of: OracleOf, tiny_llama: Path) -> Oracle:
    """The offline oracle on tiny_llama: offline(prompts, params) -> [Expected per prompt]."""
    return oracle_of(tiny_llama)
