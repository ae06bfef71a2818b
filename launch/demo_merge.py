"""Split-KV attention merged through the (O, LSE) merge layer equals attention over the whole KV.

    python launch/demo_merge.py [--seq-len 32768] [--splits 1 4 16 64]

The decode-time picture of Flash-Decoding: one query token per sequence attends to a long KV
cache cut into splits; each split yields a partial state (O, LSE); `merge_states` combines them
exactly. Prints the error of the merged result against the unsplit computation.
"""

from __future__ import annotations

import argparse
import time

import torch

import longctx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=32768, help="KV length")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 3, 16, 64])
    args = ap.parse_args()

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    B, N, Hq, Hkv, D = args.batch, args.seq_len, args.q_heads, args.kv_heads, args.head_dim
    q = torch.randn(B, 1, Hq, D, device=dev)
    k = torch.randn(B, N, Hkv, D, device=dev)
    v = torch.randn(B, N, Hkv, D, device=dev)
    print(f"device {dev}: batch {B}, KV length {N}, {Hq} query / {Hkv} KV heads, head_dim {D}, fp32")

    o_full, lse_full = longctx.attention(q, k, v, return_lse=True)
    print(f"{'splits':>6} {'max |O err|':>12} {'max |LSE err|':>14} {'ms':>8}")
    for p in args.splits:
        t0 = time.perf_counter()
        bounds = torch.linspace(0, N, p + 1).round().long().tolist()
        parts = [longctx.attention(q, k[:, a:b], v[:, a:b], return_lse=True)
                 for a, b in zip(bounds[:-1], bounds[1:])]
        o_parts = torch.stack([o for o, _ in parts])                     # [P, B, 1, Hq, D]
        lse_parts = torch.stack([lse.transpose(1, 2) for _, lse in parts])  # [P, B, 1, Hq]
        o, lse = longctx.merge_states(o_parts, lse_parts)
        ms = (time.perf_counter() - t0) * 1e3
        o_err = (o - o_full).abs().max().item()
        lse_err = (lse.transpose(1, 2) - lse_full).abs().max().item()
        print(f"{p:>6} {o_err:>12.2e} {lse_err:>14.2e} {ms:>8.1f}")
        if not (o_err < 1e-4 and lse_err < 1e-4):
            raise SystemExit(f"merged result disagrees with the full computation ({p} splits)")
    print("ok: every split count reproduces attention over the whole KV")


if __name__ == "__main__":
    main()
