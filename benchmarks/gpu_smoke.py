"""The first stage of benchmarks/gpu_check.sh: in about 30 s, whether genq's GPU path works at
all on this machine, before the GPU suite spends minutes on it.

1. versions: python, torch (and the CUDA it was built for), CuPy, the device;
2. kernels: for a few (dtype, head size, block size) variants, compile the module and launch each
   kernel once on a tiny cache through the engine's own launch path (the start-up check,
   engine/attention/kernel_check.py), results compared with torch;
3. generate: one `LLM.generate` of a tiny random Llama (head size 64, float32) with
   attention_backend="cupy", greedy output equal to transformers token for token.

Prints one line per step and writes smoke.json to --out. Exit code: 0 all passed, 1 a step
failed, 2 no CUDA device (nothing was checked). Needs only torch, cupy, transformers and numpy.

    PYTHONPATH=. python3 -m benchmarks.gpu_smoke --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

# Imported before anything runs, so that a package the lent machine lacks shows at once.
from engine import LLM, SamplingParams
from engine.attention.kernel_check import KernelCheckError, check_kernels
from tests.harness.models import build_kernel_llama

VARIANTS = ((torch.float32, 64, 16), (torch.bfloat16, 128, 16))  # the smoke model's, a served one
NUM_PROMPTS, MAX_TOKENS = 4, 16


def versions() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "torch_cuda": torch.version.cuda}
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except ImportError as e:
        info["cupy"] = f"not importable ({e})"
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return info


def check_variants(device: torch.device) -> list[dict[str, Any]]:
    results = []
    for dtype, head, block in VARIANTS:
        start = time.perf_counter()
        error = None
        try:
            check_kernels(dtype, head, block, device)
        except KernelCheckError as e:
            error = str(e)
        results.append({"variant": f"{str(dtype).removeprefix('torch.')}/h{head}/b{block}",
                        "seconds": round(time.perf_counter() - start, 2), "error": error})
    return results


def generate_equals_transformers(model_dir: Path) -> dict[str, Any]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(5, 120))]
               for _ in range(NUM_PROMPTS)]
    start = time.perf_counter()
    llm = LLM(model=str(model_dir), device="cuda", dtype="float32", attention_backend="cupy",
              num_gpu_blocks_override=256, swap_space=0.01, seed=0)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine_s = time.perf_counter() - start
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda()
    theirs = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(torch.tensor([p], device="cuda"),
                              attention_mask=torch.ones(1, len(p), device="cuda"),
                              max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=2)
            theirs.append(ids[0, len(p):].tolist())
    mismatches = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    return {"prompts": NUM_PROMPTS, "max_tokens": MAX_TOKENS, "engine_seconds": round(engine_s, 2),
            "mismatched_prompts": mismatches, "ours": ours, "transformers": theirs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"versions": versions()}
    print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), flush=True)
    failed = False
    if not torch.cuda.is_available():
        print(f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none; "
              "nothing was checked", flush=True)
        report["result"] = "no CUDA device"
    else:
        report["kernels"] = check_variants(torch.device("cuda"))
        for r in report["kernels"]:
            status = "ok" if r["error"] is None else f"FAILED: {r['error']}"
            print(f"kernels {r['variant']}: {status} ({r['seconds']} s)", flush=True)
        failed = any(r["error"] for r in report["kernels"])
        try:
            with tempfile.TemporaryDirectory() as tmp:
                report["generate"] = gen = generate_equals_transformers(
                    build_kernel_llama(Path(tmp)))
            same = not gen["mismatched_prompts"]
            print(f"generate: {gen['prompts']} prompts x {gen['max_tokens']} tokens "
                  f"{'equal to' if same else 'DIFFER from'} transformers (prompts differing: "
                  f"{gen['mismatched_prompts']}; engine {gen['engine_seconds']} s with its load)",
                  flush=True)
            failed |= not same
        except Exception as e:  # noqa: BLE001 - report any failure of the step, then go on
            report["generate"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"generate: FAILED: {type(e).__name__}: {e}", flush=True)
            failed = True
        report["result"] = "failed" if failed else "passed"
    (args.out / "smoke.json").write_text(json.dumps(report, indent=2) + "\n")
    if not torch.cuda.is_available():
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
