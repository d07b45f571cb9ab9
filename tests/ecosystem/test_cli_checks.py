"""The command line's checks: `genq submit` judges a job with the protocol's own checks and the
caps before it connects to Redis, and every command's --help gives each option's default."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.harness.fleet import free_port
from tests.harness.gateway import REPO


def genq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer.cli", *args], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("flags, message", [
    (("--temperature", "-1"), "temperature must be >= 0 (0 means greedy), got -1.0"),
    (("--n", "1000"), "n=1000 is over the cap of 16"),
    (("--top-p", "0"), "top_p must be in (0, 1], got 0.0"),
])
def test_submit_refuses_bad_params_before_it_connects(flags: tuple[str, ...],
                                                      message: str) -> None:
    """(Redis is a closed port: a check that came after connecting would say so instead.)"""
    out = genq("submit", "x", "--model", "tiny", *flags, "--redis",
               f"redis://127.0.0.1:{free_port()}/0")
    assert (out.returncode, out.stderr) == (2, f"genq submit: {message}\n")


@pytest.mark.parametrize("command", ["submit", "status", "bench", "worker", "celery-bridge",
                                     "gateway", "run-batch"])
def test_every_option_that_takes_a_value_shows_its_default(command: str) -> None:
    out = genq(command, "--help")
    assert out.returncode == 0, out.stderr
    options = re.findall(r"^  (--\S+ [A-Z{][^\n]*(?:\n {5,}[^\n]*)*)", out.stdout, re.M)
    assert len(options) >= 2
    assert [o.split()[0] for o in options
            if "default" not in o and "(required)" not in o] == []
