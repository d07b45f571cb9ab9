"""C++ for the CPU, compiled with the system compiler on first use and loaded through ctypes
(whose calls release the GIL). A build is cached under ~/.cache/genq (or $GENQ_CACHE), keyed
by the source, the compiler and the CPU it was built for (-march=native: a cache shared between
machines, such as an NFS home, must not hand one CPU another's build), so concurrent workers on
one host share it; without a compiler, or when a build fails, callers get None and run their
plain torch path."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"


def cpu_signature() -> bytes:
    """What -march=native compiles for: the CPU's model and feature flags (Linux's
    /proc/cpuinfo; elsewhere the machine and processor names)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return f"{platform.machine()} {platform.processor()}".encode()
    keys = ("vendor_id", "model name", "cpu family", "model", "flags", "Features", "CPU part")
    lines = (line for line in text.splitlines() if line.split(":")[0].strip() in keys)
    return "\n".join(dict.fromkeys(lines)).encode()  # (each line once: all cores alike)


def build_name(source: Path, compiler: str, cpu: bytes) -> str:
    """The cached build's file name for `source` built by `compiler` for `cpu`."""
    digest = hashlib.sha256(source.read_bytes())
    for part in (compiler.encode(), cpu):
        digest.update(b"\0" + part)
    return f"{source.stem}-{digest.hexdigest()[:16]}.so"


@functools.cache
def library(source: Path) -> ctypes.CDLL | None:
    """The shared library built from one C++ file (None: no compiler, or it failed)."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        logger.warning("no C++ compiler: %s falls back to plain torch", source.name)
        return None
    cache = Path(os.environ.get("GENQ_CACHE", Path.home() / ".cache" / "genq"))
    target = cache / build_name(source, compiler, cpu_signature())
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
