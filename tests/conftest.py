from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import ARCHS, build_model, build_tokenizer


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
