"""C++ for the CPU, compiled with the system compiler on first use and loaded through ctypes
(whose calls release the GIL). A build is cached per source digest under ~/.cache/genq (or
$GENQ_CACHE), so concurrent workers share it; without a compiler, or when a build fails, callers
get None and run their plain torch path."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"


@functools.cache
def library(source: Path) -> ctypes.CDLL | None:
    """The shared library built from one C++ file (None: no compiler, or it failed)."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        logger.warning("no C++ compiler: %s falls back to plain torch", source.name)
        return None
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("GENQ_CACHE", Path.home() / ".cache" / "genq"))
    target = cache / f"{source.stem}-{digest}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            built = Path(tmp) / target.name
            cmd = [compiler, "-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared",
                   "-fPIC", "-pthread", str(source), "-o", str(built)]
            # OpenMP first (the same runtime as torch's CPU ops); plain threads if unavailable.
            result = subprocess.run(cmd + ["-fopenmp"], capture_output=True, text=True)
            if result.returncode != 0:
                result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("compiling %s failed, using plain torch:\n%s", source.name,
                               result.stderr[-2000:])
                return None
            built.replace(target)  # atomic: concurrent workers never load a half-written file
    return ctypes.CDLL(str(target))
