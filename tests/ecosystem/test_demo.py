"""`make demo` (python -m benchmarks.demo): it runs the fleet end to end, prints its figures, its
completions are the offline engine's, and it leaves no process behind (also after Ctrl-C)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.harness.fleet import sigint_as_from_a_terminal
from tests.harness.gateway import MODEL_DIR, REPO
from tests.harness.oracle import OracleOf


def demo(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "benchmarks.demo", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=sigint_as_from_a_terminal)


def processes_using_port(port: int) -> list[str]:
    """Command lines of live processes started for this demo's redis port (server or worker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        line = " ".join(a.decode(errors="replace") for a in argv)
        if f"127.0.0.1:{port}/" in line or f"--port {port} " in line:
            found.append(line)
    return found


def test_demo_prints_its_figures_matches_offline_outputs_and_stops_everything(
        tmp_path: Path, oracle_of: OracleOf) -> None:
    out_json = tmp_path / "demo.json"
    proc = demo("--jobs", "4", "--max-tokens", "8", "--json", str(out_json))
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output

    port = int(re.search(r"redis-server on port (\d+)", output).group(1))
    assert re.search(r"^jobs: 4 done, 0 failed in [\d.]+ s$", output, re.M), output
    assert re.search(r"^throughput: [\d.]+ jobs/s, [\d.]+ tokens/s \(\d+ tokens\)$", output, re.M)
    assert re.search(r"^latency submit->done: p50 [\d.]+ s, p99 [\d.]+ s$", output, re.M)
    assert "stopped the 3 process(es) the demo started" in output
    assert processes_using_port(port) == []

    figures = json.loads(out_json.read_text())
    assert (figures["jobs"], figures["done"], figures["failed"]) == (4, 4, 0)
    assert sum(figures["per_worker"].values()) == 4
    assert set(figures["per_worker"]) <= {"demo-worker-1", "demo-worker-2"}
    assert figures["latency_p50_s"] <= figures["latency_p99_s"]
    completions = figures["completions"]
    assert [c["index"] for c in completions] == [0, 1, 2, 3]
    assert figures["tokens"] == sum(len(c["token_ids"]) for c in completions)

    # Seeded sampling is a pure function of (seed, index, position): the fleet's tokens are the
    # offline engine's, whichever worker ran the job.
    oracle = oracle_of(MODEL_DIR)
    for c in completions:
        [[(token_ids, text, _reason)]] = oracle([c["prompt"]], c["params"])
        assert (c["token_ids"], c["text"]) == (token_ids, text)


def test_demo_interrupted_with_ctrl_c_stops_every_process_it_started() -> None:
    # (enough work that the interrupt lands mid-run: 2 tiny jobs could end before it arrives)
    proc = demo("--jobs", "400", "--max-tokens", "64")
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("workers ready"):
            proc.send_signal(signal.SIGINT)
            break
    output = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, output
    port = int(re.search(r"redis-server on port (\d+)", output).group(1))
    assert "stopped the 3 process(es) the demo started" in output
    assert processes_using_port(port) == []
