"""Where a ring prefill's compute goes, on one GPU without communication (a development tool).

Times every attention block of each rank's zigzag ring plan alone (fused merge into a float32
state, as `ring_attention` runs it, and plain attention), against the one-device call over the
whole sequence, so that the ring's own losses (smaller blocks) are separated from communication.

    python bench/ring_blocks.py [--seq-len 32768] [--world 2] [--heads 32 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import bench_ms  # noqa: E402

from longctx.attention import attention, attention_merge_into  # noqa: E402
from longctx.parallel.ring import _step_blocks, shard_chunks  # noqa: E402

TIMING = dict(warmup_ms=50, rep_ms=300)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--heads", type=int, nargs=2, default=[32, 32], help="query heads, KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    S, W, (hq, hkv), d = args.seq_len, args.world, args.heads, args.head_dim
    q = torch.randn(1, S, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, S, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def tflops(sq: int, sk: int, causal: bool, ms: float) -> float:
        return 4 * hq * sq * sk * d * (0.5 if causal else 1.0) / ms / 1e9

    one = bench_ms(lambda: attention(q, k, v, causal=True), **TIMING)
    o_one, lse_one = attention(q, k, v, causal=True, return_lse=True)
    print(f"one device, {S} causal: {one:.3f} ms, {tflops(S, S, True, one):.0f} TFLOPS")

    def shard(x: torch.Tensor, chunks: list[tuple[int, int]]) -> torch.Tensor:
        return torch.cat([x[:, a:a + n] for a, n in chunks], 1)

    for rank in range(W):
        q_chunks = shard_chunks(S, W, rank, "zigzag")
        ql = shard(q, q_chunks)
        total = 0.0
        # The rank's whole plan folded into one state: its output shard, checked below.
        o_rank = torch.empty(ql.shape, dtype=torch.float32, device="cuda")
        lse_rank = torch.full(ql.shape[:3], float("-inf"), dtype=torch.float32, device="cuda")
        for t in range(W):
            k_chunks = shard_chunks(S, W, (rank - t) % W, "zigzag")
            kl, vl = shard(k, k_chunks), shard(v, k_chunks)
            for b in _step_blocks(q_chunks, k_chunks, True):
                sq, sk = b.q1 - b.q0, b.k1 - b.k0
                o_acc = torch.zeros(1, sq, hq, d, dtype=torch.float32, device="cuda")
                lse_acc = torch.full((1, sq, hq), float("-inf"), dtype=torch.float32, device="cuda")
                qkv = (ql[:, b.q0:b.q1], kl[:, b.k0:b.k1], vl[:, b.k0:b.k1])
                kw = dict(causal=b.masked, q_start=b.q_start, k_start=b.k_start)
                def fused_step() -> None:
                    if t == 0:  # the ring's first step merges into an empty state
                        lse_acc.fill_(float("-inf"))
                    attention_merge_into(o_acc, lse_acc, *qkv, **kw)

                fused = bench_ms(fused_step, **TIMING)
                plain = bench_ms(lambda: attention(*qkv, **kw), **TIMING)
                total += fused
                attention_merge_into(o_rank[:, b.q0:b.q1], lse_rank[:, b.q0:b.q1], *qkv, **kw)
                print(f"rank {rank} step {t}: q {sq} x k {sk} causal={b.masked}: fused {fused:.3f} ms "
                      f"({tflops(sq, sk, b.masked, fused):.0f} TFLOPS), plain {plain:.3f} ms "
                      f"({tflops(sq, sk, b.masked, plain):.0f})", flush=True)
        err = (o_rank.to(q.dtype).float() - shard(o_one, q_chunks).float()).abs().max().item()
        lse_err = (lse_rank - shard(lse_one, q_chunks)).abs().max().item()
        print(f"rank {rank}: blocks sum to {total:.3f} ms; one device / {W} = {one / W:.3f} ms; "
              f"max |O - one device| {err:.1e}, |LSE - one device| {lse_err:.1e}")


if __name__ == "__main__":
    main()
