"""Host time per layer of the CUDA attention path, on the CPU: planning plus marshalling.

A decode step of an 8B-class model (32 query / 8 KV heads, head 128, bf16, block 16, context
1024) at batch 64 and 256, each layer writing its K/V (reshape_and_cache) and attending (decode
kernel). "per layer" plans every layer's launches from the metadata, as the backend did before
launches were planned per step, and marshals them; "per step" is CupyAttentionBackend as it is:
the step's first layer plans and marshals, every layer then only writes its tensors' addresses
into the marshalled parameters. The launcher is a no-op, so what is timed is exactly what runs
on the host before CuPy's cuLaunchKernel (CuPy's own call, a few us per launch, comes on top
and is measured on a GPU by benchmarks/kernels.py). Prints the two side by side, per layer, over
32-layer steps. Times are the thread's CPU time (time.thread_time), best of the steps, so that
other processes on a shared machine inflate them less; reported, never asserted.

    PYTHONPATH=. python -m benchmarks.kernel_host [--steps 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine import kernels
from engine.attention.base import AttentionMetadata
from engine.attention.cupy_backend import CupyAttentionBackend, _rows

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 32, 8, 128, 16
CONTEXT, NUM_BLOCKS, DTYPE = 1024, 512, torch.bfloat16
TARGET_US = 25.0


class NullLauncher:
    """A kernels.Launcher that launches nothing: only the host work before the launch counts."""

    def function(self, kernel: str, variant: kernels.Variant) -> kernels.KernelFn:
        return lambda grid, block, params: None


def step_metadata(batch: int, seed: int) -> AttentionMetadata:
    g = torch.Generator().manual_seed(seed)
    blocks = CONTEXT // BLOCK_SIZE
    seq_lens = [CONTEXT - int(x) for x in torch.randint(0, BLOCK_SIZE, (batch,), generator=g)]
    return AttentionMetadata(
        slot_mapping=torch.randint(0, NUM_BLOCKS * BLOCK_SIZE, (batch,), generator=g),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.randint(0, NUM_BLOCKS, (batch, blocks), generator=g,
                                   dtype=torch.int32),
        max_query_len=1, max_seq_len=max(seq_lens), num_decode_seqs=batch,
        seq_lens_list=seq_lens, query_lens_list=[1] * batch)


Layer = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # this layer's query, key, value


def per_layer_planning(launcher: kernels.Launcher, qkv: Layer, cache: torch.Tensor,
                       meta: AttentionMetadata, layer: int, scale: float) -> torch.Tensor:
    """The step as the backend ran it before: every layer plans and marshals from scratch."""
    query, key, value = qkv
    key_cache, value_cache = cache[layer, 0], cache[layer, 1]
    launches = kernels.reshape_and_cache(_rows(key), _rows(value), key_cache, value_cache,
                                         meta.slot_mapping.to(torch.int64).contiguous())
    query = _rows(query)
    out = torch.empty(query.shape, dtype=query.dtype)
    block_tables = meta.block_tables.to(torch.int32).contiguous()
    seq_lens = meta.seq_lens.to(torch.int32).contiguous()
    nd = meta.num_decode_seqs
    launches += kernels.decode(out[:nd], query[:nd], key_cache, value_cache, block_tables[:nd],
                               seq_lens[:nd], max(meta.seq_lens_list[:nd]), scale)
    for launch in launches:
        launcher.function(launch.kernel, launch.variant)(launch.grid, launch.block,
                                                         kernels.launch_params(launch.args))
    return out


def per_step_planning(backend: CupyAttentionBackend, qkv: Layer, cache: torch.Tensor,
                      meta: AttentionMetadata, layer: int, scale: float) -> torch.Tensor:
    query, key, value = qkv
    backend.write_kv(key, value, cache[layer, 0], cache[layer, 1], meta.slot_mapping)
    return backend.forward(query, cache[layer, 0], cache[layer, 1], meta, scale)


def us_per_layer(batch: int, steps: int, planned_per_step: bool) -> float:
    cache = torch.zeros(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE,
                        dtype=DTYPE)
    fused = torch.randn(batch, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_SIZE).to(DTYPE)
    q, k, v = fused.split([NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)  # views, as in a model
    qkv = (q, k, v)
    scale = HEAD_SIZE ** -0.5
    backend = CupyAttentionBackend(NullLauncher())
    launcher = NullLauncher()
    best = float("inf")
    for step in range(steps + 2):  # (the first two warm up)
        meta = step_metadata(batch, step)  # a new step: its launches are planned anew
        start = time.thread_time()
        for layer in range(NUM_LAYERS):
            if planned_per_step:
                per_step_planning(backend, qkv, cache, meta, layer, scale)
            else:
                per_layer_planning(launcher, qkv, cache, meta, layer, scale)
        elapsed = time.thread_time() - start
        if step >= 2:
            best = min(best, elapsed)
    return best / NUM_LAYERS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/kernel_host.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"host us per layer (best of {args.steps} steps of {NUM_LAYERS} layers), decode, "
          f"{NUM_HEADS}/{NUM_KV_HEADS} heads, head {HEAD_SIZE}, bf16, context {CONTEXT}")
    print(f"{'batch':>5} {'per layer':>10} {'per step':>9} {'ratio':>6} {'target':>7}")
    rows = []
    for batch in (64, 256):
        before = us_per_layer(batch, args.steps, planned_per_step=False)
        after = us_per_layer(batch, args.steps, planned_per_step=True)
        rows.append({"batch": batch, "per_layer_planning_us": before,
                     "per_step_planning_us": after, "ratio": before / after})
        print(f"{batch:>5} {before:>10.1f} {after:>9.1f} {before / after:>6.1f} "
              f"{'ok' if after <= TARGET_US else 'MISS':>7}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"torch": torch.__version__, "target_us": TARGET_US,
                                     "rows": rows}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
