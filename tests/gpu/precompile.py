"""`python -m tests.gpu.precompile float32:64:16 bfloat16:128:32 ...` compiles those variants'
modules through CuPy, which stores them in its on-disk kernel cache: the GPU session fixture runs
several of these at once, so the tests themselves load compiled binaries."""

from __future__ import annotations

import sys

import torch

from engine import kernels


def main(specs: list[str]) -> None:
    for spec in specs:
        dtype, head, block = spec.split(":")
        kernels.compiled_module(getattr(torch, dtype), int(head), int(block), 0)


if __name__ == "__main__":
    main(sys.argv[1:])
