"""genq's engine vs Hugging Face transformers (static batching) on the same 256 requests.

    python -m benchmarks.engine_vs_hf [--requests 256] [--peer]

Tiny Llama (hidden 256, intermediate 688, 4 layers, 8 heads, 4 KV heads, vocab 8192, float32),
random weights; prompt lengths lognormal around 128 clipped to [8, 512]; output lengths lognormal
around 64 clipped to [8, 256]; random token ids; ignore_eos; greedy. transformers runs batches of
32 in arrival order with left padding, each batch until its longest request. --peer also times
vLLM's CPU build on the same workload (../shared/tools/vllm-cpu-peer). Prints a table and writes
benchmarks/results/engine_vs_hf.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.chart import save_bars

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TOKENIZER = ROOT / "models" / "genq-tiny-stdlib"


def build_model(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=1, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (TOKENIZER / name).exists():
            shutil.copy(TOKENIZER / name, path / name)
    return path


def workload(num: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)

    def lognormal(median: float, lo: int, hi: int) -> int:
        return min(max(int(rng.lognormvariate(math.log(median), 0.6)), lo), hi)

    prompts = [[rng.randrange(3, 8192) for _ in range(lognormal(128, 8, 512))] for _ in range(num)]
    return prompts, [lognormal(64, 8, 256) for _ in range(num)]


def run_engine(model: Path, prompts, max_tokens) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(str(model), num_threads=2, max_num_seqs=256, max_num_batched_tokens=2048)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "out_tokens": sum(max_tokens),
            "out_tok_s": sum(max_tokens) / wall, "steps": llm.stats()["num_steps"],
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def scheduler_step_ms(num_seqs: int = 256, steps: int = 200) -> float:
    """Mean Scheduler.schedule() time with `num_seqs` decoding sequences (no model)."""
    from engine.block_manager import BlockManager
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams
    from engine.scheduler import Scheduler
    from engine.scheduler_output import Sampled
    from engine.sequence import Sequence, SequenceGroup

    config = EngineConfig(model="unused", max_num_seqs=num_seqs, max_num_batched_tokens=65536)
    sched = Scheduler(config, BlockManager(200_000, 0, config.block_size))
    params = SamplingParams(max_tokens=10**6)
    for i in range(num_seqs):
        sched.add(SequenceGroup(str(i), params, [Sequence(i, 0, [7] * 128, 128)], 0,
                                arrival_time=float(i)))

    def step() -> float:
        t0 = time.perf_counter()
        out = sched.schedule()
        elapsed = time.perf_counter() - t0
        sched.update(out, Sampled(out.scheduled, [7] * len(out.scheduled)))
        return elapsed

    while len(sched.running) < num_seqs:
        step()
    return 1000 * sum(step() for _ in range(steps)) / steps


def run_hf(model: Path, prompts, max_tokens, batch: int = 32) -> dict:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    t0 = time.perf_counter()
    token_ids = []
    with torch.no_grad():
        for i in tqdm(range(0, len(prompts), batch), desc="transformers", unit="batch"):
            chunk, lens = prompts[i:i + batch], max_tokens[i:i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[2] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(lens),
                              do_sample=False, eos_token_id=None, pad_token_id=2)
            token_ids += [row[width:width + n].tolist() for row, n in zip(out, lens)]
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "out_tokens": sum(max_tokens), "out_tok_s": sum(max_tokens) / wall,
            "token_ids": token_ids}


def run_peer(model: Path, prompts, max_tokens) -> dict:
    tool = ROOT.parent / "shared" / "tools" / "vllm-cpu-peer"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": prompts, "max_tokens": max_tokens}, f)
    proc = subprocess.run([str(tool), str(model), f.name], capture_output=True, text=True,
                          check=True)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--peer", action="store_true", help="also time vLLM's CPU build")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    prompts, max_tokens = workload(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "bench-llama")
        results = {"requests": args.requests, "prompt_tokens": sum(map(len, prompts)),
                   "engine": run_engine(model, prompts, max_tokens)}
        if not args.skip_hf:
            results["transformers"] = run_hf(model, prompts, max_tokens)
        if args.peer:
            results["vllm_cpu"] = run_peer(model, prompts, max_tokens)
    eng = results["engine"]
    print(f"\n{'system':<22}{'wall s':>10}{'out tok/s':>12}{'ratio':>10}{'same tokens':>14}")
    print(f"{'genq engine':<22}{eng['wall_s']:>10.2f}{eng['out_tok_s']:>12.1f}{'1.00':>10}")
    for key, label in (("transformers", "transformers static"), ("vllm_cpu", "vllm-cpu 0.32")):
        if key in results:
            r = results[key]
            print(f"{label:<22}{r['wall_s']:>10.2f}{r['out_tok_s']:>12.1f}"
                  f"{eng['out_tok_s'] / r['out_tok_s']:>9.2f}x"
                  f"{agreement(eng['token_ids'], r['token_ids']):>13.0%}")
    results["scheduler_ms_at_256"] = scheduler_step_ms()
    print(f"scheduler time per step at 256 running sequences: "
          f"{results['scheduler_ms_at_256']:.3f} ms")
    RESULTS.mkdir(parents=True, exist_ok=True)
    slim = {k: ({kk: vv for kk, vv in v.items() if kk != "token_ids"} if isinstance(v, dict)
                else v) for k, v in results.items()}
    (RESULTS / "engine_vs_hf.json").write_text(json.dumps(slim, indent=2))
    bars = [("genq engine", eng["out_tok_s"])]
    bars += [(label, results[key]["out_tok_s"]) for key, label in
             (("transformers", "transformers, static batches"), ("vllm_cpu", "vLLM CPU"))
             if key in results]
    save_bars("engine_vs_hf", "output tokens/s (same requests, one run)", bars,
              title=f"{args.requests} requests, greedy, tiny Llama")


if __name__ == "__main__":
    main()
