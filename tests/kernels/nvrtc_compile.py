"""Compiles engine.kernels' module source with NVRTC (cuda-bindings), as CuPy does at run time but
with every name expression of every variant: `python -m tests.kernels.nvrtc_compile OUT ARCH`
writes OUT/genq.ptx and OUT/lowered.json ({name expression: mangled name})."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cuda.bindings import nvrtc

from engine import kernels


def _check(result: tuple, what: str) -> tuple:
    if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise SystemExit(f"{what} failed: {result[0]}")
    return result[1:]


def main(out_dir: Path, arch: str) -> None:
    major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    print(f"NVRTC {major}.{minor}")
    if (major, minor) != (13, 0):
        raise SystemExit(f"NVRTC {major}.{minor}: pin cuda-toolkit[nvrtc]==13.0.* (newer PTX is "
                         "rejected by ptxas 13.0)")
    names = sorted(kernels.all_name_expressions())
    (prog,) = _check(nvrtc.nvrtcCreateProgram(kernels.module_source().encode(), b"genq.cu", 0,
                                              [], []), "nvrtcCreateProgram")
    for name in names:
        _check(nvrtc.nvrtcAddNameExpression(prog, name.encode()), f"add {name}")
    options = [o.encode() for o in kernels.compile_options()] + [f"-arch={arch}".encode()]
    compiled = nvrtc.nvrtcCompileProgram(prog, len(options), options)
    (size,) = _check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
    log = b" " * size
    _check(nvrtc.nvrtcGetProgramLog(prog, log), "log")
    print(log.rstrip(b"\x00").decode())
    _check(compiled, "nvrtcCompileProgram")
    (size,) = _check(nvrtc.nvrtcGetPTXSize(prog), "PTX size")
    ptx = b" " * size
    _check(nvrtc.nvrtcGetPTX(prog, ptx), "PTX")
    (out_dir / "genq.ptx").write_bytes(ptx.rstrip(b"\x00"))
    lowered = {name: _check(nvrtc.nvrtcGetLoweredName(prog, name.encode()), name)[0].decode()
               for name in names}
    (out_dir / "lowered.json").write_text(json.dumps(lowered, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
