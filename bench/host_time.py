"""Host (CPU) time of eager decode calls: what a caller without CUDA graphs pays per call before
the GPU does any work. A development tool; BENCHMARKS.md quotes its numbers.

    python bench/host_time.py [--shapes 256x256 32x2048 1x65536] [--calls 1000]

Each shape: longctx.decode and SDPA (cuDNN and flash backends) over a [B, N, 2, 128] fp16 cache
with 16 query heads, µs per call as the minimum over 5 repetitions of back-to-back calls. The
calls queue faster than the GPU drains them only where GPU time exceeds host time; the table
says which by printing the graph-replay GPU time beside it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import graph_ms  # noqa: E402

import longctx  # noqa: E402


def host_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["256x256", "32x2048", "1x65536"])
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    print(f"{'B x N':>10} | {'longctx host':>12} | {'GPU (graph)':>11} | {'SDPA cuDNN host':>15} | "
          f"{'SDPA flash host':>15}  (µs per call)")
    for shape in args.shapes:
        B, N = (int(x) for x in shape.split("x"))
        q = torch.randn(B, 16, 128, device="cuda", dtype=torch.float16)
        k = torch.randn(B, N, 2, 128, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
        ours = lambda: longctx.decode(q, k, v, cache_seqlens=lens)  # noqa: E731
        qs, ks, vs = q[:, None].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        peers = []
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            with sdpa_kernel(backend):
                peers.append(host_us(
                    lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True), args.calls))
        gpu = graph_ms(ours, warmup_ms=5, rep_ms=20) * 1e3
        print(f"{shape:>10} | {host_us(ours, args.calls):12.1f} | {gpu:11.1f} | {peers[0]:15.1f} | "
              f"{peers[1]:15.1f}", flush=True)


if __name__ == "__main__":
    main()
