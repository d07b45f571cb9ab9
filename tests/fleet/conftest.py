"""Fleet fixtures: a real redis-server per test and real worker processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fleet.harness import Expected, RedisServer, WorkerFactory


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


@pytest.fixture(scope="session")
def offline(tiny_llama: Path) -> Callable[[list[str], Any], list[Expected]]:
    """The offline oracle: LLM.generate on the same model, one result per prompt as
    [(token_ids, text, finish_reason) per sequence index]."""
    from engine import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), num_gpu_blocks_override=1024, swap_space=0.01,
              num_threads=1)

    def run(prompts: list[str], params: dict[str, Any] | list[dict[str, Any]]) -> list[Expected]:
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        outs = llm.generate(prompts, [SamplingParams.from_dict(p) for p in per_prompt],
                            use_tqdm=False)
        return [[(list(c.token_ids), c.text, c.finish_reason)
                 for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]

    return run

