"""`python -m tests.gpu.precompile float32:64:16 bfloat16:128:32 ...` compiles those variants'
modules through CuPy, which stores them in its on-disk kernel cache: the GPU session fixture runs
several of these at once, so the tests themselves load compiled binaries."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engine import kernels


def run_children(commands: list[list[str]], cwd: Path) -> list[tuple[int, str]]:
    """Runs `sys.executable *command` for every command at once; (exit code, stderr) of each.
    Every child's stderr is read while it runs (communicate, one thread per child): a child
    that writes more than a pipe holds (64 KB: a long compile log) would otherwise block on the
    full pipe and never exit."""
    procs = [subprocess.Popen([sys.executable, *command], cwd=cwd, stderr=subprocess.PIPE,
                              text=True) for command in commands]
    with ThreadPoolExecutor(max(1, len(procs))) as pool:
        errs = list(pool.map(lambda p: p.communicate()[1], procs))
    return [(p.returncode, err) for p, err in zip(procs, errs, strict=True)]


def main(specs: list[str]) -> None:
    for spec in specs:
        dtype, head, block = spec.split(":")
        kernels.compiled_module(getattr(torch, dtype), int(head), int(block), 0)


if __name__ == "__main__":
    main(sys.argv[1:])
