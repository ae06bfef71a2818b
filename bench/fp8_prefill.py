"""A prefill chunk's attention over a long fp8 history, three ways on one GPU: `longctx.attention`
on the fp8 cache in the model's layout (on an H100 / H200 the history dequantized a block of keys
at a time through the Gluon kernel, kernels/prefill.py `_attend_fp8_blocks`), the same call on the
Triton kernel's fp8 path (`prefill_kernel("triton")`: e4m3 tiles widened in registers), and
`longctx.attention` on the bf16 values. CodeLlama-34B's heads on one GPU (64 / 8, D=128), a chunk
of 8192 queries, causal by absolute position at the end of the history; ms and TFLOPS (causal
FLOPs), the fp8 outputs' max difference from the bf16 call's. Also the dequantization of the
whole history's K (the blocks' copies): torch's `longctx.fp8.dequantize_kv` against the kernel
(`longctx.ops.dequantize_kv` on CUDA), with its bytes' time at the GPU's read bandwidth.

    python bench/fp8_prefill.py [--keys 16384 65536 262144]

With --rows, the rule between the Triton kernel's two fp8 forms instead: per number of query
rows L (causal at the end of --keys keys) and heads Hq / Hkv, the Triton kernel widening the
e4m3 tiles (its launch config given, which keeps the call on that form), the history as
dequantized blocks through the Triton kernel (`_attend_fp8_blocks` under
`prefill_kernel("triton")`), the Triton kernel on the bf16 values, and `longctx.attention`'s own
choice under `prefill_kernel("triton")` and in auto (the Gluon kernel where it applies).

    python bench/fp8_prefill.py --rows 16 64 256 1024 8192 --keys 65536
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import bench_ms  # noqa: E402

import longctx  # noqa: E402
from longctx import ops  # noqa: E402
from longctx.fp8 import dequantize_kv, model_layout, quantize_kv  # noqa: E402
from longctx.hardware import read_bandwidth  # noqa: E402
from longctx.kernels.utils import device_capability  # noqa: E402
from longctx.kernels import prefill as kp  # noqa: E402
from longctx.kernels.prefill import prefill_kernel  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[16384, 65536, 262144])
    ap.add_argument("--rows", type=int, nargs="+", help="the Triton kernel's rule sweep (above)")
    ap.add_argument("--heads", type=str, nargs="+", default=["64/8", "16/2", "32/32"],
                    help="Hq/Hkv pairs of the --rows sweep")
    ap.add_argument("--head-dim", type=int, default=128, help="of the --rows sweep")
    args = ap.parse_args()
    if args.rows:
        return rows_sweep(args.rows, args.keys, [tuple(map(int, h.split("/"))) for h in args.heads],
                          args.head_dim)
    torch.manual_seed(0)
    hq, hkv, d, L = 64, 8, 128, 8192
    print(torch.cuda.get_device_name())
    bw = read_bandwidth(torch.device("cuda"))[0]
    for N in args.keys:
        q = torch.randn(1, L, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, N, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
        k8, v8, ks, vs = model_layout(k8, v8, ks, vs)
        kd, vd = dequantize_kv(k8, ks, torch.bfloat16), dequantize_kv(v8, vs, torch.bfloat16)
        kw = dict(causal=True, q_start=N - L)

        def f_fp8():
            return longctx.attention(q, k8, v8, k_scale=ks, v_scale=vs, **kw)

        def f_bf16():
            return longctx.attention(q, kd, vd, **kw)

        def f_tri():
            with prefill_kernel("triton"):
                return longctx.attention(q, k8, v8, k_scale=ks, v_scale=vs, **kw)

        ob = f_bf16().float()
        e8, et = ((f().float() - ob).abs().max().item() for f in (f_fp8, f_tri))
        flops = 4 * hq * L * d * (N - L / 2)
        t8, tb, tt = (bench_ms(f, 20, 200) for f in (f_fp8, f_bf16, f_tri))
        print(f"N={N}: fp8 (blocks) {t8:.2f} ms ({flops / t8 / 1e9:.0f} TFLOPS, diff {e8:.1e}) | "
              f"fp8 Triton kernel {tt:.2f} ms ({flops / tt / 1e9:.0f}, diff {et:.1e}) | bf16 "
              f"{tb:.2f} ms ({flops / tb / 1e9:.0f}) | blocks/bf16 {t8 / tb:.3f}x, "
              f"Triton/blocks {tt / t8:.2f}x", flush=True)
        assert torch.equal(ops.dequantize_kv(k8, ks, torch.bfloat16), kd)
        assert torch.equal(ops.dequantize_kv(v8, vs, torch.bfloat16), vd)
        td, tk = (bench_ms(lambda: f(k8, ks, torch.bfloat16), 20, 200)
                  for f in (dequantize_kv, ops.dequantize_kv))
        floor = k8.numel() * 3 / bw * 1e3  # e4m3 in, bf16 out
        print(f"  dequantize K ({k8.numel() * 3 / 1e6:.0f} MB moved): torch {td:.2f} ms | kernel "
              f"{tk:.3f} ms (bit for bit; {floor:.3f} ms at the read bandwidth)", flush=True)
        del q, k, v, k8, v8, ks, vs, kd, vd
        torch.cuda.empty_cache()


def rows_sweep(rows: list[int], keys: list[int], heads: list[tuple[int, int]], d: int) -> None:
    """The --rows table (module docstring): ms per form, and which form is faster."""
    torch.manual_seed(0)
    cap = device_capability(torch.device("cuda"))
    print(torch.cuda.get_device_name(), f"Triton {triton.__version__}, head_dim {d}")
    print(f"{'N':>7} {'heads':>6} {'L':>5} | {'widen':>8} {'blocks':>8} {'bf16':>8} | "
          f"{'triton':>8} {'auto':>8} | widen/blocks")
    for N in keys:
        for hq, hkv in heads:
            k = torch.randn(1, N, hkv, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
            k8, v8, ks, vs = model_layout(k8, v8, ks, vs)
            kd, vd = dequantize_kv(k8, ks, torch.bfloat16), dequantize_kv(v8, vs, torch.bfloat16)
            del k, v
            for L in (x for x in rows if x <= N):
                q = torch.randn(1, L, hq, d, device="cuda", dtype=torch.bfloat16)
                kw = dict(causal=True, q_start=N - L, k_start=0)
                cfg = kp.launch_config(d, q.dtype, True, L, N, fp8=True, capability=cap)

                def widen():
                    return kp.flash_attention_fwd(q, k8, v8, softmax_scale=d ** -0.5, k_scale=ks,
                                                  v_scale=vs, _config=cfg, **kw)

                def blocks():
                    with prefill_kernel("triton"):
                        return kp._attend_fp8_blocks(q, k8, v8, ks, vs, d ** -0.5, True, N - L,
                                                     0, None)

                def bf16():
                    with prefill_kernel("triton"):
                        return kp.flash_attention_fwd(q, kd, vd, softmax_scale=d ** -0.5, **kw)

                def triton_choice():
                    with prefill_kernel("triton"):
                        return longctx.attention(q, k8, v8, k_scale=ks, v_scale=vs, causal=True,
                                                 q_start=N - L)

                def auto():
                    return longctx.attention(q, k8, v8, k_scale=ks, v_scale=vs, causal=True,
                                             q_start=N - L)

                ref = bf16()[0].float()
                for f in (widen, blocks, triton_choice, auto):
                    err = (f()[0].float() - ref).abs().max().item()
                    assert err < 0.05, (f.__name__, N, hq, hkv, L, err)
                t = [bench_ms(f, 10, 60) for f in (widen, blocks, bf16, triton_choice, auto)]
                print(f"{N:>7} {hq:>3}/{hkv:<2} {L:>5} | " + " ".join(f"{x:8.3f}" for x in t[:3])
                      + " | " + " ".join(f"{x:8.3f}" for x in t[3:]) + f" | {t[0] / t[1]:.2f}x",
                      flush=True)
                del q
            del k8, v8, ks, vs, kd, vd
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
