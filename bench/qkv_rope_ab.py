"""A decode step's q/k/v projection, RoPE and KV store: the GEMV then `rope_store_kv` (two
launches, what the model runs) against `gemv_rope_store` (kernels/gemv.py: one GEMV whose
epilogue rotates and stores), on CodeLlama-34B's shapes at tp = 1, 2, 4 (64 / 8 heads split,
head_dim 128, dim 8192), bf16, batch 1.

    python bench/qkv_rope_ab.py [--tp 1 2 4] [--rounds 5]

Each variant is a chain of one step's 48 layers over distinct weight copies (every weight from
HBM, as in a model step) and their own caches, captured in one CUDA graph (PDL as the model
launches it) and timed in interleaved rounds (launch/bench.py interleaved_ms); µs per layer, the
median round, with the floor (the weight's bytes at the measured read bandwidth). Both variants'
q and caches are first checked against each other on the first layer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import capture_graph, interleaved_ms  # noqa: E402

from longctx.kernels.bandwidth import read_bandwidth  # noqa: E402
from longctx.kernels.fused import rope_store_kv  # noqa: E402
from longctx.kernels.gemv import gemv, gemv_rope_store  # noqa: E402
from longctx.ops import rope_tables  # noqa: E402

DIM, HQ, HKV, D, LAYERS, S_MAX = 8192, 64, 8, 128, 48, 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dt, dev, bw = torch.bfloat16, torch.device("cuda"), read_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, read bandwidth "
          f"{bw / 1e12:.2f} TB/s; bf16, batch 1, chains of {LAYERS} layers in one CUDA graph")
    cos, sin = rope_tables(S_MAX, D, 1e6, dev)
    pos = torch.tensor([S_MAX - 7], device=dev)
    slot = pos.clone()
    rows = []
    for tp in args.tp:
        hq, hkv = HQ // tp, max(1, HKV // tp)
        n = (hq + 2 * hkv) * D
        ws = [torch.randn(n, DIM, device=dev, dtype=dt) * DIM**-0.5 for _ in range(LAYERS)]
        x = torch.randn(1, DIM, device=dev, dtype=dt)
        caches = {v: [torch.zeros(2, 1, S_MAX, hkv, D, device=dev, dtype=dt)
                      for _ in range(LAYERS)] for v in ("two launches", "one GEMV")}

        def two(i, w):
            kc, vc = caches["two launches"][i]
            q, k, v = gemv(x, w).view(1, hq + 2 * hkv, D).split([hq, hkv, hkv], dim=1)
            rope_store_kv(q, k, v, cos, sin, pos, kc, vc, slot)
            return q[0]

        def one(i, w):
            kc, vc = caches["one GEMV"][i]
            return gemv_rope_store(x, w, hq, hkv, cos, sin, pos, kc, vc, slot)

        q2, q1 = two(0, ws[0]), one(0, ws[0])
        torch.testing.assert_close(q1.float(), q2.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(caches["one GEMV"][0].float(),
                                   caches["two launches"][0].float(), rtol=1e-2, atol=1e-2)
        graphs = {name: capture_graph(lambda f=f: [f(i, w) for i, w in enumerate(ws)]).replay
                  for name, f in (("two launches", two), ("one GEMV", one))}
        times = interleaved_ms(graphs, args.rounds, 10, 50)
        us = {name: t[len(t) // 2] * 1e3 / LAYERS for name, t in times.items()}
        floor = n * DIM * 2 / bw * 1e6
        rows.append((tp, n, floor, us))
        print(f"  tp={tp} [{n}, {DIM}]: floor {floor:.1f}, "
              + ", ".join(f"{k} {v:.2f}" for k, v in us.items()), flush=True)
        del ws, caches, graphs
        torch.cuda.empty_cache()
    print("\n| tp | weight | floor µs | two launches | one GEMV | saved per layer | x 48 layers |")
    print("|---|---|---|---|---|---|---|")
    for tp, n, floor, us in rows:
        a, b = us["two launches"], us["one GEMV"]
        print(f"| {tp} | {n} x {DIM} | {floor:.1f} | {a:.2f} | {b:.2f} | {a - b:+.2f} µs | "
              f"{(a - b) * LAYERS:+.0f} µs |")


if __name__ == "__main__":
    main()
