"""engine/native.py: the cache of C++ builds is keyed by source, compiler and CPU."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.native import build_name, cpu_signature, library


def test_a_build_is_named_by_its_source_compiler_and_cpu(tmp_path: Path) -> None:
    source = tmp_path / "kernel.cpp"
    source.write_text("int f() { return 1; }\n")
    name = build_name(source, "/usr/bin/g++", b"flags : avx2")
    assert name.startswith("kernel-") and name.endswith(".so") and len(name) == len("kernel-") + 19
    assert build_name(source, "/usr/bin/g++", b"flags : avx2") == name
    assert build_name(source, "/usr/bin/g++", b"flags : avx2 avx512f") != name  # another CPU
    assert build_name(source, "/usr/bin/clang++", b"flags : avx2") != name
    source.write_text("int f() { return 2; }\n")
    assert build_name(source, "/usr/bin/g++", b"flags : avx2") != name


def test_the_cpu_signature_holds_the_feature_flags_and_nothing_that_varies() -> None:
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo")
    lines = cpu_signature().decode().splitlines()
    assert any(line.startswith(("flags", "Features")) for line in lines)
    assert not any("MHz" in line or "bogomips" in line.lower() for line in lines)
    assert len(lines) == len(set(lines))  # (one line per distinct value, not one per core)
    assert cpu_signature() == cpu_signature()


def test_library_builds_into_the_cache_under_that_name_and_loads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("GENQ_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "answer.cpp"
    source.write_text('extern "C" int genq_answer() { return 42; }\n')
    lib = library(source)
    assert lib is not None and lib.genq_answer() == 42
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [
        build_name(source, compiler, cpu_signature())]
