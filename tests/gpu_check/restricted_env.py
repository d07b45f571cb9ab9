"""A Python environment with only what a lent GPU machine has: torch, cupy, transformers, numpy,
pytest and what they require (no extras). It is a directory of links to those distributions'
files in this interpreter's site-packages; `python -S` with that directory on PYTHONPATH sees
nothing else installed (no redis, hiredis, jsonschema, openai, fastapi, uvicorn, celery, ...).
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LENT_MACHINE_PACKAGES = ("torch", "cupy-cuda13x", "transformers", "numpy", "pytest")


def required_closure(roots: tuple[str, ...]) -> set[str]:
    """The installed distributions among `roots` and everything they require, transitively
    (requirements behind an extra left out, markers evaluated for this interpreter)."""
    seen: set[str] = set()
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # cupy here: the lent machine has it, this one does not
        seen.add(name)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def build_site(root: Path, roots: tuple[str, ...] = LENT_MACHINE_PACKAGES) -> Path:
    """Links each top-level entry (package, module, .so, .dist-info) of the closure's
    distributions into `root`; returns `root`."""
    root.mkdir(parents=True, exist_ok=True)
    for name in sorted(required_closure(roots)):
        dist = metadata.distribution(name)
        base = Path(str(dist.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        if not tops:
            raise RuntimeError(f"{name} lists no installed files (no RECORD): cannot link it")
        for top in sorted(tops - {"..", "__pycache__"}):
            target = root / top
            if (base / top).exists() and not target.exists():
                target.symlink_to(base / top)
    return root


def restricted_env(site: Path, repo: Path) -> dict[str, str]:
    """Environment for `sys.executable -S ...`: the repository and `site` on the path, no
    pytest plugins auto-loaded (none of the lent machine's would be)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "PYTEST")) and k != "VIRTUAL_ENV"}
    env.update(PYTHONPATH=f"{repo}{os.pathsep}{site}", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
               PYTHONDONTWRITEBYTECODE="1")
    return env


def command(*args: str) -> list[str]:
    return [sys.executable, "-S", *args]
