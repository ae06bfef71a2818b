"""Tuning sweep for the FlashAttention forward (a development tool; its results are the launch
table in kernels/prefill.py). Times every (BLOCK_M, BLOCK_N, warps, stages) config in both grid
orders (heads fastest / query tiles fastest) on the prefill benchmark's shapes, with SDPA's
cuDNN backend as the yardstick, and prints TFLOPS (causal FLOPs halved).

    python bench/tune_prefill.py [--shapes 16/2/16384/1 32/32/65536/0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import bench_ms  # noqa: E402

from longctx.kernels.prefill import flash_attention_fwd, launch_config  # noqa: E402

SHAPES = [f"{h}/{n}/{c}" for h in ("16/2", "32/32") for n in (4096, 16384, 65536) for c in (1, 0)]
CONFIGS = ["128,64,8,2,128", "128,64,8,2", "128,128,8,3", "128,64,8,3", "64,64,4,3",
           "128,32,8,3,128", "128,128,8,2,168"]
TIMING = dict(warmup_ms=20, rep_ms=60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=SHAPES,
                    help="Hq/Hkv/N/causal or, without a mask, Hq/Hkv/NqxNk/0 (a ring's blocks)")
    ap.add_argument("--configs", nargs="+", default=CONFIGS,
                    help="BLOCK_M,BLOCK_N,warps,stages[,maxnreg] (maxnreg caps registers per thread, "
                         "e.g. 128 lets two 8-warp programs share an SM)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", default=None, help="write every timing here")
    args = ap.parse_args()
    d = args.head_dim
    rows = []
    for shape in args.shapes:
        hq, hkv, n, causal = shape.split("/")
        hq, hkv, causal = int(hq), int(hkv), bool(int(causal))
        nq, nk = (int(x) for x in n.split("x")) if "x" in n else (int(n), int(n))
        if causal and nq != nk:
            raise SystemExit(f"{shape}: causal shapes are square here (a ring's diagonal blocks)")
        q = torch.randn(1, nq, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, nk, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        flops = 4 * hq * nq * nk * d * (0.5 if causal else 1.0)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms = bench_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                 enable_gqa=True), **TIMING)
        row = {"shape": shape, "cudnn": flops / ms / 1e9, "configs": {}}

        def run(cfg: dict | None) -> float:
            return bench_ms(lambda: flash_attention_fwd(q, k, v, softmax_scale=d**-0.5,
                                                        causal=causal, q_start=0, k_start=0,
                                                        _config=cfg), **TIMING)

        # the table's config passed explicitly: without _config a Hopper GPU runs the Gluon kernel
        table = launch_config(d, torch.bfloat16, causal, nq, nk)
        row["table"] = flops / run(table) / 1e9
        row["table_config"] = ",".join(str(table[k]) for k in ("BLOCK_M", "BLOCK_N", "num_warps",
                                                                  "num_stages", "maxnreg") if k in table)
        row["table_config"] += ",m" if table["M_FASTEST"] else ""
        for c in args.configs:
            bm, bn, w, st, *reg = (int(x) for x in c.split(","))
            for m_fast in (False, True):
                name = f"{c}{',m' if m_fast else ''}"
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st, M_FASTEST=m_fast)
                if reg:
                    cfg["maxnreg"] = reg[0]
                try:
                    row["configs"][name] = flops / run(cfg) / 1e9
                except Exception as e:  # a variant that does not compile or fit is listed as such
                    row["configs"][name] = f"{type(e).__name__}"
        ok = {k: x for k, x in row["configs"].items() if isinstance(x, float)}
        best = max(ok, key=ok.get)
        print(f"{shape:>14}  cudnn {row['cudnn']:4.0f}  table {row['table']:4.0f} "
              f"({row['table_config']})  best {best} {ok[best]:4.0f}  | "
              + " ".join(f"{k}={x if isinstance(x, str) else round(x)}"
                         for k, x in row["configs"].items()), flush=True)
        rows.append(row)
        del q, k, v, qt, kt, vt
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
