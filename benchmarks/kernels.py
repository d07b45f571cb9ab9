"""Attention on a GPU: genq's paged kernels against the device's copy bandwidth and torch SDPA.

Decode, for batch 1/16/64/256 x context 512/2048/8192 (head 128, bf16, 32 query / 8 KV heads,
block 16, random block tables): the K/V bytes a decode step must read, divided by the kernel's
time, as a fraction of the bandwidth of a plain device-to-device copy (bytes read + written per
second) measured in the same run; the time of SDPA on K/V already gathered into contiguous
tensors, and of gather + SDPA (what attention costs without paged kernels); and the host time of
one layer's call (CupyAttentionBackend.forward replaying the step's planned launches: what each
layer costs the CPU). Prefill of whole prompts: genq's prefill kernel against SDPA (what the
backend runs for fresh prompts on CUDA), device and host time. GPU times come from CUDA events
around iterations queued behind a sleep kernel, so host launch overhead is not counted in them.
Prints tables and writes JSON. Timing is reported, never asserted.

    PYTHONPATH=. python3 -m benchmarks.kernels [--quick] [--json benchmarks/results/kernels.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.attention.cupy_backend import CupyAttentionBackend

BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 2048, 8192)
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def timed(fn: Callable[[], object], iters: int) -> tuple[float, float]:
    """(GPU seconds, host seconds) per call of fn; the host time is that of queueing the calls
    behind a sleep kernel, the GPU time excludes it."""
    fn()  # warm-up (and compile)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time while the host queues the iterations
    start.record()
    host_start = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - host_start) / iters
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters, host


def gpu_time(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call of fn on the GPU, launch overhead hidden behind a sleep kernel."""
    return timed(fn, iters)[0]


def metadata(batch: int, query_len: int, context: int, tables: torch.Tensor) -> AttentionMetadata:
    """`batch` sequences of `context` tokens whose last `query_len` are this step's."""
    dev = tables.device
    return AttentionMetadata(
        slot_mapping=torch.zeros(batch * query_len, dtype=torch.int64, device=dev),
        query_start_loc=torch.arange(0, batch * query_len + 1, query_len, dtype=torch.int32,
                                     device=dev),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=dev),
        block_tables=tables, max_query_len=query_len, max_seq_len=context,
        num_decode_seqs=batch if query_len == 1 else 0, seq_lens_list=[context] * batch,
        query_lens_list=[query_len] * batch)


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
    query = torch.randn(batch, num_heads, HEAD_SIZE, device="cuda", dtype=DTYPE, generator=g)
    scale = HEAD_SIZE ** -0.5
    backend = CupyAttentionBackend()
    meta = metadata(batch, 1, context, tables)  # one step: every call replays its launches
    kv_bytes = 2 * batch * context * num_kv_heads * HEAD_SIZE * key_cache.element_size()
    iters = max(3, min(50, int(2e10 // max(kv_bytes, 1))))
    genq_s, host_s = timed(lambda: backend.forward(query, key_cache, value_cache, meta, scale),
                           iters)
    out = backend.forward(query, key_cache, value_cache, meta, scale)

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
        "genq_us": genq_s * 1e6, "genq_host_us": host_s * 1e6,
        "genq_read_gbps": kv_bytes / genq_s / 1e9,
        "fraction_of_copy_bw": kv_bytes / genq_s / copy_bw,
        "sdpa_gathered_us": sdpa_s * 1e6, "gather_sdpa_us": gather_s * 1e6,
        "speedup_vs_sdpa": sdpa_s / genq_s, "speedup_vs_gather_sdpa": gather_s / genq_s,
        "max_abs_diff_vs_sdpa": max_diff, "partitions": math.ceil(context / 512),
    }

def bench_prefill(batch: int, prompt_len: int) -> dict[str, float]:
    """`batch` whole prompts of `prompt_len` tokens (their K/V written to the cache first): the
    prefill kernel and SDPA, each through CupyAttentionBackend.forward."""
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + prompt_len)
    num_tokens, blocks_per_seq = batch * prompt_len, -(-prompt_len // BLOCK_SIZE)
    key_cache = torch.zeros(batch * blocks_per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE,
                            device="cuda", dtype=DTYPE)
    value_cache = torch.zeros_like(key_cache)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32,
                          device="cuda").view(batch, blocks_per_seq)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE,
                        generator=g)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE,
                      generator=g)
    value = torch.randn_like(key)
    meta = metadata(batch, prompt_len, prompt_len, tables)
    # Token j of prompt i sits in block i * blocks_per_seq + j // BLOCK_SIZE, row j % BLOCK_SIZE.
    positions = torch.arange(prompt_len, device="cuda")
    meta.slot_mapping = (torch.arange(batch, device="cuda")[:, None] * blocks_per_seq
                         * BLOCK_SIZE + positions).view(-1)
    scale = HEAD_SIZE ** -0.5
    kernel = CupyAttentionBackend(prompts_by_sdpa=False)
    sdpa = CupyAttentionBackend(prompts_by_sdpa=True)
    kernel.write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
    iters = max(3, min(20, int(4e7 // (batch * prompt_len * prompt_len))))
    results = {}
    for name, backend in (("kernel", kernel), ("sdpa", sdpa)):
        def attend(b: CupyAttentionBackend = backend) -> torch.Tensor:
            return b.forward(query, key_cache, value_cache, meta, scale, key=key, value=value)

        results[name] = timed(attend, iters)
    diff = (kernel.forward(query, key_cache, value_cache, meta, scale, key=key, value=value).float()
            - sdpa.forward(query, key_cache, value_cache, meta, scale, key=key, value=value)
            .float()).abs().max()
    return {"batch": batch, "prompt_len": prompt_len,
            "kernel_us": results["kernel"][0] * 1e6, "kernel_host_us": results["kernel"][1] * 1e6,
            "sdpa_us": results["sdpa"][0] * 1e6, "sdpa_host_us": results["sdpa"][1] * 1e6,
            "sdpa_speedup": results["kernel"][0] / results["sdpa"][0],
            "max_abs_diff": float(diff)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/kernels.json"))
    parser.add_argument("--quick", action="store_true",
                        help="batch 64 x context 2048 decode and one prefill row only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA device")
    copy_bw = copy_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"{device}: device copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")
    print(f"decode, head {HEAD_SIZE}, bf16, block {BLOCK_SIZE}; heads = query/kv")
    header = (f"{'batch':>5} {'ctx':>5} {'heads':>6} {'KV MB':>8} {'genq us':>9} {'host us':>8} "
              f"{'GB/s':>7} {'% copy':>7} {'sdpa us':>9} {'gath+sdpa':>10} {'x sdpa':>7} "
              f"{'x g+s':>6} {'maxdiff':>8}")
    print(header)
    # The grid plus one MHA row: a CTA serves one query head, so with GQA the query heads of a KV
    # head re-read it (from L2); the MHA row at the same bytes shows what that costs.
    configs = [(b, c, NUM_HEADS, NUM_KV_HEADS) for b in BATCHES for c in CONTEXTS]
    configs.append((64, 2048, NUM_KV_HEADS, NUM_KV_HEADS))
    if args.quick:
        configs = [(64, 2048, NUM_HEADS, NUM_KV_HEADS)]
    rows = []
    for batch, context, heads, kv_heads in configs:
        r = bench(batch, context, copy_bw, heads, kv_heads)
        rows.append(r)
        print(f"{batch:>5} {context:>5} {f'{heads}/{kv_heads}':>6} {r['kv_bytes'] / 1e6:>8.1f} "
              f"{r['genq_us']:>9.1f} {r['genq_host_us']:>8.1f} {r['genq_read_gbps']:>7.0f} "
              f"{100 * r['fraction_of_copy_bw']:>6.1f}% {r['sdpa_gathered_us']:>9.1f} "
              f"{r['gather_sdpa_us']:>10.1f} {r['speedup_vs_sdpa']:>7.2f} "
              f"{r['speedup_vs_gather_sdpa']:>6.2f} {r['max_abs_diff_vs_sdpa']:>8.4f}", flush=True)
        torch.cuda.empty_cache()
    target = rows[[c[:2] for c in configs].index((64, 2048))]
    print(f"batch 64, context 2048: {100 * target['fraction_of_copy_bw']:.1f}% of copy bandwidth "
          "(target 80%)")
    print(f"prefill of whole prompts, {NUM_HEADS}/{NUM_KV_HEADS} heads, head {HEAD_SIZE}, bf16: "
          "genq's prefill kernel vs SDPA (the backend's choice on CUDA)")
    print(f"{'batch':>5} {'prompt':>6} {'kernel us':>10} {'host us':>8} {'sdpa us':>9} "
          f"{'host us':>8} {'x sdpa':>7} {'maxdiff':>8}")
    prefill_rows = []
    for batch, prompt_len in [(1, 2048)] if args.quick else [(1, 2048), (1, 8192), (8, 1024)]:
        p = bench_prefill(batch, prompt_len)
        prefill_rows.append(p)
        print(f"{batch:>5} {prompt_len:>6} {p['kernel_us']:>10.1f} {p['kernel_host_us']:>8.1f} "
              f"{p['sdpa_us']:>9.1f} {p['sdpa_host_us']:>8.1f} {p['sdpa_speedup']:>7.2f} "
              f"{p['max_abs_diff']:>8.4f}", flush=True)
        torch.cuda.empty_cache()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"device": device, "torch": torch.__version__,
                                     "copy_bandwidth_bytes_per_s": copy_bw, "rows": rows,
                                     "prefill_rows": prefill_rows}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
