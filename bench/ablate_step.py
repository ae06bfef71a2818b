"""Decode-step time of CodeLlama-34B (or a tp=2 rank's shard of it) on one GPU with one part of
the step removed at a time: upper bounds on what fusing that part away could save. A
development tool for timing only -- with a part removed the outputs are wrong.

    python bench/ablate_step.py [--shard] [--context 16384] [--steps 60]

--shard builds what one rank of tp=2 computes: 32 query / 4 KV heads, intermediate 11008,
vocabulary 16000 (the same weight shapes per GEMV), without the all-reduces. Random weights,
bf16, batch 1; the KV cache holds `context` positions (their values do not matter for time).
Each variant is captured in a CUDA graph; the median step of `steps` replays is printed with
the share of the floor (weight bytes + KV bytes read) / HBM read bandwidth.
"""

from __future__ import annotations

import argparse

import torch

import longctx.kernels.decode as kernels_decode
import longctx.model as model_mod
from longctx.config import ModelArgs
from longctx.generate import DecodeStep
from longctx.hardware import read_bandwidth
from longctx.parallel.build import build_model
from longctx.weights import RandomWeights

PARTS = ("rms_norm", "rope_store_kv", "decode")


def _no_norm(x, weight, eps, add=None):
    return (x, x) if add is not None else x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shard", action="store_true", help="a tp=2 rank's shard instead of the full model")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    half = 2 if a.shard else 1
    args = ModelArgs(name="codellama34b" + ("-tp2-shard" if a.shard else ""), n_layers=48,
                     dim=8192, n_heads=64 // half, n_kv_heads=8 // half, head_dim=128,
                     intermediate_size=22016 // half, vocab_size=32000 // half, rope_theta=1e6)
    dev = torch.device("cuda")
    ctx, n = a.context, a.steps
    model = build_model(args, weights=RandomWeights(0), device=dev, dtype=torch.bfloat16,
                        batch=1, max_seq_len=ctx + n + 64)
    bw, _ = read_bandwidth(dev)
    weight_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                       if "embed" not in name)  # a step reads one embedding row
    kv_bytes = 2 * args.n_layers * ctx * args.n_kv_heads * args.head_dim * 2
    floor_ms = (weight_bytes + kv_bytes) / bw * 1e3
    print(f"{args.name}, context {ctx}: weights {weight_bytes / 1e9:.2f} GB + KV {kv_bytes / 1e9:.2f} GB, "
          f"read bandwidth {bw / 1e12:.2f} TB/s, floor {floor_ms:.3f} ms")

    orig = {p: getattr(model_mod, p) for p in PARTS}
    orig_splits = kernels_decode.choose_num_splits
    variants = {
        "as it runs": {},
        "without the RMSNorm kernels": {"rms_norm": _no_norm},
        # A decode step's RoPE and KV store are one kernel (ops.rope_store_kv).
        "without the RoPE + KV store kernel": {"rope_store_kv": lambda *args: None},
        "without attention (q as its output)": {"decode": lambda q, *args, **kw: q},
        "half the heuristic's split count": {
            "splits": lambda *args, **kw: max(1, orig_splits(*args, **kw) // 2)},
        "twice the heuristic's split count": {
            "splits": lambda *args, **kw: orig_splits(*args, **kw) * 2},
        "as it runs, again": {},
    }
    try:
        for name, patch in variants.items():
            for p in PARTS:
                setattr(model_mod, p, patch.get(p, orig[p]))
            kernels_decode.choose_num_splits = patch.get("splits", orig_splits)
            ms = _median_step_ms(model, ctx, n, dev)
            print(f"{name:38s} {ms:8.3f} ms/step  {floor_ms / ms * 100:5.1f}% of the floor", flush=True)
    finally:
        for p in PARTS:
            setattr(model_mod, p, orig[p])
        kernels_decode.choose_num_splits = orig_splits


def _median_step_ms(model, ctx: int, n: int, dev: torch.device) -> float:
    with torch.no_grad():
        step = DecodeStep(model, torch.zeros(1, dtype=torch.int64, device=dev), ctx, n + 32,
                          temperature=0.0, top_p=1.0, cuda_graph=True)
        for _ in range(5):
            step()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        for i in range(n):
            events[i].record()
            step()
        events[n].record()
        torch.cuda.synchronize()
        times = sorted(x.elapsed_time(y) for x, y in zip(events[:-1], events[1:]))
    return times[len(times) // 2]


if __name__ == "__main__":
    main()
