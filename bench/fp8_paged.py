"""The decode kernel on a paged fp8 cache: the usual layout against the model's layout within each
page (K and the scales head-major, V key-major: `longctx.fp8.model_layout(paged=True)`, vLLM's
paged V layout), beside the contiguous fp8 cache in the model's layout, the bf16 cache paged, and
vLLM's Triton decode kernel on an fp8 cache in the same pages (launch/bench.py's `vllm_fp8_peer`:
per-tensor scales, its best of 4-64 splits; skipped with a note without its file,
bench/fetch_vllm_peer.sh).

    python bench/fp8_paged.py [--pages 16 256] [--rounds 3]   # a CUDA GPU of capability >= 8.9

Sequence b's pages in order (as the vLLM peer takes them). Every variant is first checked against
the float32 reference on the values it reads; then µs per call, CUDA-graph replays taking turns
within each round (launch/bench.py interleaved_median_us), the median round. Prints one table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import attention_ref, capture_graph, interleaved_median_us, vllm_fp8_peer  # noqa: E402

import longctx  # noqa: E402
from longctx.fp8 import dequantize_kv, model_layout, quantize_kv  # noqa: E402
from longctx.kernels.bandwidth import read_bandwidth  # noqa: E402

SHAPES = [(16, 2, 64, 1024), (16, 2, 8, 8192), (16, 2, 1, 65536), (16, 2, 1, 262144),
          (32, 4, 8, 8192), (32, 4, 1, 262144), (64, 8, 1, 262144)]


def variants(hq: int, hkv: int, B: int, N: int, pages: list[int]):
    """{name: (fn, fp32 reference of what it reads)} for one shape, and the fp8 cache's bytes."""
    torch.manual_seed(0)
    q = torch.randn(B, hq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, N, hkv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    ref8 = attention_ref(q, dequantize_kv(kq, ks), dequantize_kv(vq, vs))
    ref16 = attention_ref(q, k, v)

    def call(kk, vv, sc, table=None):
        return lambda: longctx.decode(q, kk, vv, cache_seqlens=lens, block_table=table, **sc)
    km, vm, ksm, vsm = model_layout(kq, vq, ks, vs)
    out = {"fp8 contiguous, model layout": (call(km, vm, dict(k_scale=ksm, v_scale=vsm)), ref8)}
    for ps in pages:
        table = torch.arange(B * N // ps, device="cuda", dtype=torch.int32).view(B, N // ps)
        kp, vp, ksp, vsp = (t.view(B * N // ps, ps, *t.shape[2:]) for t in (kq, vq, ks, vs))
        out[f"fp8 pages of {ps}, usual layout"] = (
            call(kp, vp, dict(k_scale=ksp, v_scale=vsp), table), ref8)
        kpm, vpm, kspm, vspm = model_layout(kp, vp, ksp, vsp, paged=True)
        out[f"fp8 pages of {ps}, model layout"] = (
            call(kpm, vpm, dict(k_scale=kspm, v_scale=vspm), table), ref8)
        out[f"bf16 pages of {ps}"] = (call(*(t.view(B * N // ps, ps, hkv, 128) for t in (k, v)),
                                           {}, table), ref16)
        try:
            make, ref = vllm_fp8_peer(q, k, v, ps)
            out[f"vLLM fp8 pages of {ps}"] = (make(), ref)
        except FileNotFoundError as e:
            print(f"  vLLM skipped: {e}")
    return out, 2 * (kq.numel() + 4 * ks.numel())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    bw = read_bandwidth()
    print(f"{torch.cuda.get_device_name()}, read {bw / 1e12:.2f} TB/s; bf16 q, D=128, µs "
          f"(median of {args.rounds} interleaved rounds of CUDA-graph replays), max |err| "
          f"against float32 on the values each reads")
    for hq, hkv, B, N in SHAPES:
        fns, fp8_bytes = variants(hq, hkv, B, N, args.pages)
        errs = {}
        for name, (fn, ref) in fns.items():
            errs[name] = (fn().float() - ref).abs().max().item()
            assert errs[name] < 5e-2, (name, errs[name])
        us = interleaved_median_us({n: capture_graph(f).replay for n, (f, _) in fns.items()},
                                   args.rounds)
        print(f"\n{hq}/{hkv} heads, {B} x {N}: fp8 floor {fp8_bytes / bw * 1e6:.1f} µs")
        for name in fns:
            print(f"  {name:<34} {us[name]:>8.1f}   err {errs[name]:.1e}")
        del fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
