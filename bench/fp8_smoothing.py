"""What the fp8 cache's smoothing costs (longctx.fp8): the decode kernel adding the means to each
split's state, and the prefill's pass over its output (`add_kv_means`), against the same calls
on a plain fp8 cache.

    python bench/fp8_smoothing.py [--rounds 5]   # a CUDA GPU of capability >= 8.9

Decode: the model's layout (K and the scales head-major, V key-major), contiguous, and the usual
layout in pages of 16. Prefill: a chunk's queries at the end of an fp8 history, causal (the
model's prefill over its cache). K and V have channels far from zero (K's outliers, as trained
models' keys have); each variant is first checked against the float32 reference on the values
it reads (the dequantized cache, plus the means where smoothed). µs per call, CUDA-graph replays
taking turns within each round (launch/bench.py interleaved_median_us), the median round.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import attention_ref, capture_graph, interleaved_median_us  # noqa: E402

import longctx  # noqa: E402
from longctx.fp8 import dequantize_kv, kv_means, model_layout, quantize_kv  # noqa: E402

DECODE = [(16, 2, 64, 1024), (16, 2, 8, 8192), (16, 2, 1, 65536), (16, 2, 1, 262144),
          (32, 4, 8, 8192), (32, 4, 1, 262144), (64, 8, 1, 262144)]
PREFILL = [(32, 4, 4096, 65536), (64, 8, 8192, 32768)]  # heads, chunk, history incl. the chunk


def _cache(B: int, N: int, hkv: int, smooth: bool):
    """An fp8 cache [B, N, hkv, 128] of offset K / V: (kq, vq, ks, vs, means dict, fp32 K, V)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (B, N, hkv, 128)
    k = torch.randn(shape, device="cuda", generator=g) + 4 * (
        torch.randn(1, 1, hkv, 128, device="cuda", generator=g)
        * (torch.rand(128, device="cuda", generator=g) < 0.1))
    v = torch.randn(shape, device="cuda", generator=g) + torch.randn(1, 1, hkv, 128, device="cuda",
                                                                     generator=g)
    k, v = k.bfloat16(), v.bfloat16()
    means = dict(k_mean=kv_means(k), v_mean=kv_means(v)) if smooth else {}
    km, vm = (means["k_mean"][:, None], means["v_mean"][:, None]) if smooth else (None, None)
    (kq, ks), (vq, vs) = quantize_kv(k, km), quantize_kv(v, vm)
    return kq, vq, ks, vs, means, dequantize_kv(kq, ks, mean=km), dequantize_kv(vq, vs, mean=vm)


def decode_variants(hq: int, hkv: int, B: int, N: int):
    q = torch.randn(B, hq, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
    out = {}
    for smooth in (False, True):
        kq, vq, ks, vs, means, k32, v32 = _cache(B, N, hkv, smooth)
        ref = attention_ref(q, k32, v32)
        del k32, v32
        tag = ", smoothed" if smooth else ""
        kk, vv, kss, vss = model_layout(kq, vq, ks, vs)
        out["model layout" + tag] = (lambda kk=kk, vv=vv, kss=kss, vss=vss, m=means: longctx.decode(
            q, kk, vv, cache_seqlens=lens, k_scale=kss, v_scale=vss, **m), ref)
        ps = 16
        table = torch.arange(B * N // ps, device="cuda", dtype=torch.int32).view(B, N // ps)
        kp, vp, ksp, vsp = (t.view(B * N // ps, ps, *t.shape[2:]) for t in (kq, vq, ks, vs))
        out["pages of 16, usual layout" + tag] = (
            lambda kp=kp, vp=vp, ksp=ksp, vsp=vsp, m=means: longctx.decode(
                q, kp, vp, cache_seqlens=lens, block_table=table, k_scale=ksp, v_scale=vsp, **m),
            ref)
    return out


def prefill_variants(hq: int, hkv: int, S: int, N: int):
    q = torch.randn(1, S, hq, 128, device="cuda", dtype=torch.bfloat16)
    out = {}
    for smooth in (False, True):
        kq, vq, ks, vs, means, k32, v32 = _cache(1, N, hkv, smooth)
        # The reference for the last CHECK_ROWS queries (the float32 scores of all would not fit).
        r = CHECK_ROWS
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, -r:].float().transpose(1, 2), k32.transpose(1, 2), v32.transpose(1, 2),
            enable_gqa=True,
            attn_mask=torch.ones(r, N, dtype=torch.bool, device="cuda").tril(N - r)
        ).transpose(1, 2)
        del k32, v32
        kk, vv, kss, vss = model_layout(kq, vq, ks, vs)
        out["model layout" + (", smoothed" if smooth else "")] = (
            lambda kk=kk, vv=vv, kss=kss, vss=vss, m=means: longctx.attention(
                q, kk, vv, causal=True, q_start=N - S, k_scale=kss, v_scale=vss, **m), ref)
    return out


CHECK_ROWS = 128


def run(title: str, fns: dict, rounds: int) -> None:
    errs = {}
    for name, (fn, ref) in fns.items():
        got = fn()
        got = got[:, -ref.shape[1]:] if got.dim() == 4 else got  # prefill: the checked rows
        errs[name] = (got.float() - ref).abs().max().item()
        assert errs[name] < 5e-2, (name, errs[name])
    us = interleaved_median_us({n: capture_graph(f).replay for n, (f, _) in fns.items()}, rounds)
    print(f"\n{title}")
    for name in fns:
        plain = us.get(name.removesuffix(", smoothed"))
        rel = f"   {us[name] / plain:.3f}x plain" if name.endswith("smoothed") else ""
        print(f"  {name:<36} {us[name]:>9.1f}   err {errs[name]:.1e}{rel}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}; bf16 q, D=128, µs (median of {args.rounds} "
          "interleaved rounds of CUDA-graph replays), max |err| against float32 on the values "
          "each reads")
    for hq, hkv, B, N in DECODE:
        run(f"decode {hq}/{hkv} heads, {B} x {N}", decode_variants(hq, hkv, B, N), args.rounds)
        torch.cuda.empty_cache()
    for hq, hkv, S, N in PREFILL:
        run(f"prefill {hq}/{hkv} heads, {S} queries at the end of {N} keys, causal",
            prefill_variants(hq, hkv, S, N), args.rounds)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
