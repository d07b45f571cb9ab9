"""Decode attention on a GPU: genq's paged kernel against the device's copy bandwidth and against
torch SDPA over gathered K/V.

For batch 1/16/64/256 x context 512/2048/8192 (head 128, bf16, 32 query / 8 KV heads, block 16,
random block tables): the K/V bytes a decode step must read, divided by the kernel's time, as a
fraction of the bandwidth of a plain device-to-device copy (bytes read + written per second)
measured in the same run; and the time of SDPA on K/V already gathered into contiguous tensors,
and of gather + SDPA (what attention costs without paged kernels). GPU times come from CUDA events
around iterations queued behind a sleep kernel, so host launch overhead is not counted. Prints a
table and writes JSON. Timing is reported, never asserted.

    PYTHONPATH=. python3 -m benchmarks.kernels [--json benchmarks/results/kernels.json]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import kernels

BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 2048, 8192)
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def gpu_time(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call of fn on the GPU, launch overhead hidden behind a sleep kernel."""
    fn()  # warm-up (and compile)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time while the host queues the iterations
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def copy_bandwidth() -> float:
    """Bytes moved (read + written) per second by a 2 GiB device-to-device copy."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = gpu_time(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() / seconds


def bench(batch: int, context: int, copy_bw: float,
          num_heads: int = NUM_HEADS, num_kv_heads: int = NUM_KV_HEADS) -> dict[str, float]:
    g = torch.Generator(device="cuda").manual_seed(batch * 100_000 + context)
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE, device="cuda",
                            dtype=DTYPE, generator=g)
    value_cache = torch.randn_like(key_cache)
    tables = torch.randperm(num_blocks, device="cuda", generator=g).view(batch, blocks_per_seq)
    tables = tables.to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, num_heads, HEAD_SIZE, device="cuda", dtype=DTYPE, generator=g)
    out = torch.empty_like(query)
    scale = HEAD_SIZE ** -0.5
    launches = kernels.decode(out, query, key_cache, value_cache, tables, seq_lens, context, scale)
    kv_bytes = 2 * batch * context * num_kv_heads * HEAD_SIZE * key_cache.element_size()
    iters = max(3, min(50, int(2e10 // max(kv_bytes, 1))))
    genq_s = gpu_time(lambda: kernels.run_launches(launches), iters)

    def gather() -> tuple[torch.Tensor, torch.Tensor]:
        shape = (batch, context, num_kv_heads, HEAD_SIZE)
        k = key_cache[tables.long()].view(shape).transpose(1, 2)
        v = value_cache[tables.long()].view(shape).transpose(1, 2)
        return k, v

    q4 = query.unsqueeze(2)  # [batch, heads, 1, head]
    k, v = gather()

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    def gather_sdpa() -> torch.Tensor:
        kk, vv = gather()
        return F.scaled_dot_product_attention(q4, kk, vv, scale=scale, enable_gqa=True)

    max_diff = float((out.float() - sdpa().squeeze(2).float()).abs().max())
    sdpa_s = gpu_time(sdpa, iters)
    gather_s = gpu_time(gather_sdpa, iters)
    return {
        "batch": batch, "context": context, "num_heads": num_heads,
        "num_kv_heads": num_kv_heads, "kv_bytes": kv_bytes,
        "genq_us": genq_s * 1e6, "genq_read_gbps": kv_bytes / genq_s / 1e9,
        "fraction_of_copy_bw": kv_bytes / genq_s / copy_bw,
        "sdpa_gathered_us": sdpa_s * 1e6, "gather_sdpa_us": gather_s * 1e6,
        "speedup_vs_sdpa": sdpa_s / genq_s, "speedup_vs_gather_sdpa": gather_s / genq_s,
        "max_abs_diff_vs_sdpa": max_diff, "partitions": math.ceil(context / 512),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/kernels.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA device")
    copy_bw = copy_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"{device}: device copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")
    print(f"decode, head {HEAD_SIZE}, bf16, block {BLOCK_SIZE}; heads = query/kv")
    header = (f"{'batch':>5} {'ctx':>5} {'heads':>6} {'KV MB':>8} {'genq us':>9} {'GB/s':>7} "
              f"{'% copy':>7} {'sdpa us':>9} {'gath+sdpa':>10} {'x sdpa':>7} {'x g+s':>6} "
              f"{'maxdiff':>8}")
    print(header)
    # The grid plus one MHA row: a CTA serves one query head, so with GQA the query heads of a KV
    # head re-read it (from L2); the MHA row at the same bytes shows what that costs.
    configs = [(b, c, NUM_HEADS, NUM_KV_HEADS) for b in BATCHES for c in CONTEXTS]
    configs.append((64, 2048, NUM_KV_HEADS, NUM_KV_HEADS))
    rows = []
    for batch, context, heads, kv_heads in configs:
        r = bench(batch, context, copy_bw, heads, kv_heads)
        rows.append(r)
        print(f"{batch:>5} {context:>5} {f'{heads}/{kv_heads}':>6} {r['kv_bytes'] / 1e6:>8.1f} "
              f"{r['genq_us']:>9.1f} {r['genq_read_gbps']:>7.0f} "
              f"{100 * r['fraction_of_copy_bw']:>6.1f}% {r['sdpa_gathered_us']:>9.1f} "
              f"{r['gather_sdpa_us']:>10.1f} {r['speedup_vs_sdpa']:>7.2f} "
              f"{r['speedup_vs_gather_sdpa']:>6.2f} {r['max_abs_diff_vs_sdpa']:>8.4f}", flush=True)
        torch.cuda.empty_cache()
    target = rows[[c[:2] for c in configs].index((64, 2048))]
    print(f"batch 64, context 2048: {100 * target['fraction_of_copy_bw']:.1f}% of copy bandwidth "
          "(target 80%)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"device": device, "torch": torch.__version__,
                                     "copy_bandwidth_bytes_per_s": copy_bw, "rows": rows},
                                    indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
