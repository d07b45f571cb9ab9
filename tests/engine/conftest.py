"""Engine fixtures: LLMs checked for leaked blocks, and a tiny llama that ends on EOS often."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM
from tests.harness.engine import EOS_ID, KV_CACHE_MEMORY, assert_drained


@pytest.fixture
def make_llm():
    """Build LLMs for a test and check after it that none leaked a block."""
    made: list[LLM] = []

    def make(model_dir: Path, **config) -> LLM:
        config.setdefault("swap_space", 0.05)
        if "num_gpu_blocks_override" not in config:
            config.setdefault("kv_cache_memory", KV_CACHE_MEMORY)
        llm = LLM(str(model_dir), **config)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert_drained(llm)


@pytest.fixture(scope="session")
def eos_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama with EOS_ID as its EOS token (config and generation config), a token it
    often generates, so that EOS endings happen within a few tokens."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("eos_llama") / "model"
    shutil.copytree(tiny_llama, path)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = EOS_ID
        (path / name).write_text(json.dumps(config))
    return path

