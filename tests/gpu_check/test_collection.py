"""`pytest -m gpu tests/gpu` collects on a lent GPU machine, which has torch, cupy, transformers,
numpy and pytest but none of the fleet's packages (redis, hiredis, jsonschema, openai, fastapi,
uvicorn, celery, msgpack, ...): the collection runs here in an environment with only those."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.gpu_check.restricted_env import build_site, command, restricted_env

REPO = Path(__file__).resolve().parents[2]
COLLECT = ("-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           "tests/gpu")


@pytest.fixture(scope="module")
def lent_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_site(tmp_path_factory.mktemp("lent_site"))


def _node_ids(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("tests/gpu/")]


def test_the_restricted_environment_lacks_the_fleets_packages(lent_site: Path) -> None:
    probe = ("import importlib.util as u; print(sorted(n for n in ('redis', 'hiredis', "
             "'jsonschema', 'openai', 'fastapi', 'uvicorn', 'celery', 'msgpack', 'hypothesis') "
             "if u.find_spec(n)), bool(u.find_spec('torch')), bool(u.find_spec('transformers')))")
    done = subprocess.run(command("-c", probe), cwd=REPO, env=restricted_env(lent_site, REPO),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[] True True"


def test_the_gpu_suite_collects_without_the_fleets_packages(lent_site: Path) -> None:
    restricted = subprocess.Popen(command(*COLLECT), cwd=REPO,
                                  env=restricted_env(lent_site, REPO), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
    full = subprocess.run(command(*COLLECT)[:1] + list(COLLECT), cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    out = restricted.communicate(timeout=300)[0]
    assert restricted.returncode == 0, out[-4000:]
    assert full.returncode == 0, full.stdout[-4000:]
    expected = _node_ids(full.stdout)
    assert "tests/gpu/test_engine_gpu.py::test_swap_preemption_on_cuda_keeps_greedy_output" \
        in expected
    assert _node_ids(out) == expected
    assert f"{len(expected)} tests collected" in out
