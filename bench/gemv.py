"""Decode-step projection efficiency on the CodeLlama-34B shapes: torch's linear (cuBLAS)
against longctx's Triton GEMV (kernels/gemv.py; its heuristic config and a few others) at batch
1, and against its skinny GEMM at batch 2-16 (`--rows`). The weights are most of a decode
step's bytes, so this is the ceiling a model step can reach.

    python bench/gemv.py [--tp 1] [--dtype bfloat16] [--shapes o down] [--configs 4,1024,4]
    python bench/gemv.py --rows 8 [--configs 32,128,4,4 64,128,4,4]   # the skinny GEMM

Each shape is timed as a chain of linears over distinct weight copies (> 4x the L2, so every
weight comes from HBM, as in a model step), captured in one CUDA graph and timed with
launch/bench.py's graph_ms (median of replays, cold L2); µs per linear and the
bandwidth it reaches are printed against the streaming-read bandwidth of the same GPU.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import graph_ms  # noqa: E402

from longctx.kernels.bandwidth import read_bandwidth  # noqa: E402
from longctx.kernels.gemv import gemv, skinny_gemm  # noqa: E402




def chain_us(out_f: int, in_f: int, dtype: torch.dtype, fn=F.linear,
             min_bytes: int = 1 << 30, rows: int = 1) -> float:
    copies = max(4, -(-min_bytes // (out_f * in_f * 2)))
    ws = [torch.randn(out_f, in_f, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, in_f, device="cuda", dtype=dtype)
    ref = x.float() @ ws[0].float().T
    err = (fn(x, ws[0]).float() - ref).abs().max().item()
    assert err <= 2 * torch.finfo(dtype).eps * ref.abs().max().item(), f"{fn}: max error {err}"

    def step():
        for w in ws:
            fn(x, w)

    us = graph_ms(step, warmup_ms=5, rep_ms=20) * 1e3 / copies
    del ws
    torch.cuda.empty_cache()
    return us


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, default=1, help="batch rows (> 1: the skinny GEMM)")
    p.add_argument("--configs", nargs="*", default=[],
                   help="extra Triton configs: BLOCK_N,BLOCK_K,warps (GEMV, e.g. 8,512,4) or "
                        "BLOCK_N,BLOCK_K,warps,stages (skinny GEMM)")
    p.add_argument("--shapes", nargs="*", default=[],
                   help="only these linears (names as printed, e.g. o down 'qkv fused')")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    bw = read_bandwidth()
    dim, inter, hq, hkv, hd, vocab = 8192, 22016, 64, 8, 128, 32000
    t = a.tp
    shapes = {
        "q": (hq * hd // t, dim), "k or v": (max(1, hkv // t) * hd, dim),
        "qkv fused": ((hq // t + 2 * max(1, hkv // t)) * hd, dim), "o": (dim, hq * hd // t),
        "gate or up": (inter // t, dim), "gate_up fused": (2 * inter // t, dim),
        "down": (dim, inter // t), "lm_head": (vocab // t, dim),
    }
    unknown = set(a.shapes) - set(shapes)
    if unknown:
        raise SystemExit(f"unknown --shapes {sorted(unknown)}; choose from {list(shapes)}")
    shapes = {k: v for k, v in shapes.items() if not a.shapes or k in a.shapes}
    print(f"{torch.cuda.get_device_name()}  read bandwidth {bw / 1e12:.2f} TB/s  tp={t} {a.dtype}"
          f"  {a.rows} row(s)")
    kernel = gemv if a.rows == 1 else skinny_gemm
    variants = {"cuBLAS": F.linear, "triton": kernel}
    for cfg in a.configs:
        variants[f"triton {cfg}"] = functools.partial(kernel, config=tuple(int(v) for v in cfg.split(",")))
    print(f"{'linear':<14} {'out x in':>14} {'MB':>7} {'floor µs':>9}  " +
          "  ".join(f"{v:>16}" for v in variants))
    for name, (o, i) in shapes.items():
        nbytes = o * i * torch.finfo(dtype).bits // 8
        floor = nbytes / bw * 1e6
        cells = []
        for fn in variants.values():
            us = chain_us(o, i, dtype, fn, rows=a.rows)
            cells.append(f"{us:8.1f} µs {100 * floor / us:3.0f}%")
        print(f"{name:<14} {f'{o}x{i}':>14} {nbytes / 1e6:7.1f} {floor:9.1f}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
