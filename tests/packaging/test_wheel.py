"""The built wheel: the base install is a client without torch, the kernel sources travel inside
it, and a client from one install gets a job done by a worker served from another.

The wheel is built once from a copy of the sources it ships. Two fresh venvs install it,
non-editable:
- `client`: the base install, resolved by pip (redis, hiredis, msgpack);
- `served`: the wheel with --no-deps, its `worker` extra's requirements taken from the test
  runner's own environment (a .pth; the test checks each requirement is met there), since
  installing torch anew would cost most of this module's time. genq itself comes from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.fleet import RedisServer, WorkerProcess, wait_heartbeats
from tests.harness.oracle import Oracle

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("pyproject.toml", "README.md", "engine", "worker", "producer", "cuda")


def run(args: list[str | Path], cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    """A command outside the checkout: no PYTHONPATH, so imports come from the venv alone."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=600)
    if check:
        assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in SHIPPED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", dist, src], src)
    [built] = dist.glob("genq-*.whl")
    return built


@pytest.fixture(scope="module")
def client_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("client") / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], venv.parent)
    run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--quiet",
         wheel], venv.parent)
    return venv


@pytest.fixture(scope="module")
def served_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("served") / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], venv.parent)
    target = site_packages(venv)
    run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--target", target, wheel], venv.parent)
    # The runner's import path after the venv's own site-packages (which holds genq): the
    # checkout is left out, and .pth files in those folders (an editable install's) are not read.
    lines = [p for p in sys.path if p and Path(p).is_dir() and Path(p).resolve() != ROOT]
    (target / "runner-environment.pth").write_text("\n".join(lines) + "\n")
    return venv


def test_the_wheel_carries_the_kernel_and_shim_sources_and_no_cuda_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert sorted(n for n in names if n.startswith("engine/cuda_sources/")) == sorted(
        f"engine/cuda_sources/{p.name}" for p in (ROOT / "cuda").iterdir())
    for folder in ("engine/attention/csrc", "engine/csrc"):  # the shim; the CPU kernels
        assert sorted(n for n in names if n.startswith(f"{folder}/")) == sorted(
            f"{folder}/{p.name}" for p in (ROOT / folder).iterdir() if p.suffix in (".cpp", ".h"))
    assert sorted({n.split("/")[0] for n in names}) == [
        "engine", "genq-0.1.0.dist-info", "producer", "worker"]


def test_the_base_install_is_a_client_without_torch(client_venv: Path) -> None:
    python = client_venv / "bin" / "python"
    probe = ("import importlib.util as u, json, producer; print(json.dumps({'producer': "
             "producer.__file__, 'absent': [m for m in ('torch', 'transformers', 'numpy', "
             "'fastapi', 'cuda') if u.find_spec(m) is None]}))")
    found = json.loads(run([python, "-c", probe], client_venv).stdout)
    assert found == {"producer": str(site_packages(client_venv) / "producer" / "__init__.py"),
                     "absent": ["torch", "transformers", "numpy", "fastapi", "cuda"]}


@pytest.mark.parametrize(("command", "extra", "absent"), [
    ("worker", "worker", "torch, transformers, safetensors, tokenizers, numpy, tqdm, "
                         "prometheus_client"),
    ("gateway", "gateway", "fastapi, uvicorn, pydantic"),
    ("run-batch", "gateway", "pydantic"),
    ("celery-bridge", "celery", "celery"),
])
def test_a_command_of_an_extra_names_its_install_line(client_venv: Path, command: str,
                                                      extra: str, absent: str) -> None:
    result = run([client_venv / "bin" / "genq", command, "--help"], client_venv, check=False)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (f"genq {command}: needs the '{extra}' extra, which this install "
                             f"lacks (no module {absent}): pip install 'genq[{extra}]'\n")


def test_an_installed_engine_finds_its_kernel_sources_in_the_wheel(served_venv: Path) -> None:
    from engine import kernels

    probe = ("import json; from importlib import metadata; import engine; "
             "from engine import kernels; from engine.attention import cuda_shim; "
             "from packaging.requirements import Requirement; "
             "reqs = [Requirement(r) for r in metadata.requires('genq')]; "
             "print(json.dumps({'engine': engine.__file__, 'cuda': str(kernels.CUDA_DIR), "
             "'csrc': str(cuda_shim.CSRC), 'digest': kernels.cuda_digest(), "
             "'unmet': [str(r) for r in reqs if r.marker and r.marker.evaluate({'extra': "
             "'worker'}) and metadata.version(r.name) not in r.specifier]}))")
    found = json.loads(run([served_venv / "bin" / "python", "-c", probe], served_venv).stdout)
    site = site_packages(served_venv)
    assert found == {"engine": str(site / "engine" / "__init__.py"),
                     "cuda": str(site / "engine" / "cuda_sources"),
                     "csrc": str(site / "engine" / "attention" / "csrc"),
                     "digest": kernels.cuda_digest(), "unmet": []}


@pytest.fixture
def served_worker(served_venv: Path, redis_server: RedisServer, tiny_llama: Path,
                  tmp_path: Path) -> Iterator[WorkerProcess]:
    """A worker run from the served venv's wheel install."""
    log = tmp_path / "worker.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = [served_venv / "bin" / "python", "-m", "producer.cli", "worker", "--redis",
            redis_server.url, "--model", tiny_llama, "--served-model-name", "tiny", "--device",
            "cpu", "--name", "wheel", "--num-threads", "1", "--num-gpu-blocks-override", "64",
            "--swap-space", "0.01"]
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(a) for a in args], cwd=tmp_path, stdout=out,
                                stderr=subprocess.STDOUT, env={**env, "OMP_NUM_THREADS": "1"})
    worker = WorkerProcess(proc, "wheel", log)
    try:
        wait_heartbeats(redis_server, [worker])
        yield worker
    finally:
        worker.kill9()


def test_a_client_without_torch_gets_a_job_done_by_a_worker_from_the_wheel(
        client_venv: Path, served_worker: WorkerProcess, redis_server: RedisServer,
        offline: Oracle) -> None:
    result = run([client_venv / "bin" / "genq", "submit", "the quick brown", "--model", "tiny",
                  "--redis", redis_server.url, "--max-tokens", "5", "--temperature", "0",
                  "--json"], client_venv)
    done = json.loads(result.stdout)
    assert [(o["token_ids"], o["text"], o["finish_reason"]) for o in done["outputs"]] == offline(
        ["the quick brown"], {"max_tokens": 5, "temperature": 0})[0]
