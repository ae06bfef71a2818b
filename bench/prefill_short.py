"""Where the Hopper prefill dispatch should switch kernels (needs an sm_90 GPU).

    python bench/prefill_short.py

For bf16, D=128, B=1, (Hq, Hkv) in (16, 2), (32, 32), 1024-8192 rows, causal or not: the Gluon
kernel called directly (`hopper_attention_fwd`, whatever the dispatch rule says), the Triton kernel
(longctx.attention with LONGCTX_PREFILL_KERNEL=triton) and SDPA over cuDNN, 5 interleaved rounds of
launch/bench.py's bench_ms, TFLOPS of the median (causal FLOPs halved). The rule in
kernels/prefill.py (`hopper_kernel_applies`) was set from its output
(bench/results/prefill-short-h100.txt).
"""
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import bench_ms  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from longctx.attention import attention  # noqa: E402
from longctx.kernels.prefill_hopper import hopper_attention_fwd  # noqa: E402


def main() -> None:
    scale = 128 ** -0.5
    for hq, hkv in [(16, 2), (32, 32)]:
        for n in [1024, 2048, 4096, 8192]:
            for causal in [True, False]:
                q = torch.randn(1, n, hq, 128, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(1, n, hkv, 128, device="cuda", dtype=torch.bfloat16)
                v = torch.randn_like(k)
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

                def gluon():
                    return hopper_attention_fwd(q, k, v, softmax_scale=scale, causal=causal,
                                                q_start=0, k_start=0)[0]

                def triton_():
                    os.environ["LONGCTX_PREFILL_KERNEL"] = "triton"
                    try:
                        return attention(q, k, v, causal=causal)
                    finally:
                        os.environ.pop("LONGCTX_PREFILL_KERNEL")

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                              enable_gqa=hq != hkv)

                err = (gluon().float() - triton_().float()).abs().max().item()
                times: dict[str, list[float]] = {"gluon": [], "triton": [], "cudnn": []}
                for _ in range(5):
                    for name, fn in (("gluon", gluon), ("triton", triton_), ("cudnn", cudnn)):
                        times[name].append(bench_ms(fn))
                flops = 4 * hq * n * n * 128 * (0.5 if causal else 1.0)
                tf = {name: flops / statistics.median(t) / 1e9 for name, t in times.items()}
                print(f"{hq}/{hkv} {n:6d} causal={causal!s:5}  gluon {tf['gluon']:6.0f}  "
                      f"triton {tf['triton']:6.0f}  cudnn {tf['cudnn']:6.0f}  "
                      f"|gluon-triton| {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
