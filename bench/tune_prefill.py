"""Tuning sweep for the FlashAttention forward (a development tool; results inform the autotune
config set in kernels/prefill.py). Times every (BLOCK_M, BLOCK_N, warps, stages, warp
specialisation) variant on a few benchmark shapes, with SDPA's cuDNN backend as the yardstick.

    python bench/tune_prefill.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import bench_ms  # noqa: E402

from longctx.kernels.prefill import flash_attention_fwd  # noqa: E402


SHAPES = [(16, 2, 16384, True), (16, 2, 16384, False), (32, 32, 16384, True), (32, 32, 65536, False)]
CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
           (128, 64, 8, 2), (128, 128, 4, 2)]


def main() -> None:
    for hq, hkv, n, causal in SHAPES:
        q = torch.randn(1, n, hq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, n, hkv, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        flops = 4 * hq * n * n * 128 * (0.5 if causal else 1.0)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms = bench_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                 enable_gqa=True), 20, 60)
        res = [f"cudnn {flops / ms / 1e9:.0f}"]
        for (bm, bn, w, st), ws in [(c, ws) for c in CONFIGS for ws in (False, True)]:
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st, WARP_SPECIALIZE=ws)
            try:
                ms = bench_ms(lambda: flash_attention_fwd(q, k, v, softmax_scale=128**-0.5,
                                                          causal=causal, q_start=0, k_start=0,
                                                          _config=cfg), 20, 60)
                res.append(f"{bm}/{bn}/{w}/{st}{'/ws' if ws else ''} {flops / ms / 1e9:.0f}")
            except Exception as e:  # a variant that does not compile or fit is listed as such
                res.append(f"{bm}/{bn}/{w}/{st}{'/ws' if ws else ''} {type(e).__name__}")
        print(f"{hq}/{hkv} N={n} causal={causal}: " + " | ".join(res), flush=True)
        del q, k, v, qt, kt, vt


if __name__ == "__main__":
    main()
