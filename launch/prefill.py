"""Ring-attention prefill of a synthetic context over all ranks, timed against one device.

    torchrun --nproc_per_node=8 launch/prefill.py seq_len=65536 q_heads=32 kv_heads=8 \
        head_dim=128 dtype=bfloat16          # one GPU per rank (nccl, device = LOCAL_RANK)
    torchrun --nproc_per_node=2 launch/prefill.py   # CPU: gloo, the small defaults
    python launch/prefill.py                 # one rank

Each rank builds only its own shard (in `layout`) of a random q/k/v sequence and runs
`ring_attention`. Rank 0 prints the time per call (slowest rank), TFLOPS per rank (causal FLOPs
halved), and, when the sequence fits on one device, the same kernel (`longctx.attention`) on the
full sequence there: its time, the parallel efficiency t_1 / (W x t_W), and the ring output's
max error against it. Until the Triton FlashAttention kernel lands, `longctx.attention` on CUDA is
the reference, which materialises [B, Hq, S/W, S/W] scores per ring step (and [B, Hq, S, S] for
the one-device run, which is skipped on out-of-memory).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig

import longctx
from longctx.parallel import init_from_env, ring_attention, unshard_sequence
from longctx.parallel.process_group import rank_and_world
from longctx.parallel.ring import shard_chunks

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}


def synthetic_qkv(cfg: DictConfig, chunks: list[tuple[int, int]], device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, L, Hq, D], k/v [B, L, Hkv, D] for the given (start, length) chunks, concatenated.

    Each chunk is drawn from a generator seeded by its start position, so a rank builds only its
    own shard and rank 0 can rebuild the full sequence from the same chunks.
    """
    dtype = DTYPES[cfg.dtype]
    parts: list[list[torch.Tensor]] = [[], [], []]
    for start, length in chunks:
        g = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + start)
        for part, heads in zip(parts, (cfg.q_heads, cfg.kv_heads, cfg.kv_heads)):
            x = torch.randn(cfg.batch, length, heads, cfg.head_dim, generator=g, device=device)
            part.append(x.to(dtype))
    q, k, v = (torch.cat(p, dim=1) for p in parts)
    return q, k, v


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], object], cfg: DictConfig, device: torch.device,
                     all_ranks: bool) -> float:
    """Mean wall time of `fn` over cfg.iters calls after cfg.warmup; with all_ranks, every rank
    calls it in step and the slowest rank's time is returned."""
    for _ in range(cfg.warmup):
        fn()
    _sync(device)
    if all_ranks:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(cfg.iters):
        fn()
    _sync(device)
    dt = (time.perf_counter() - t0) / cfg.iters
    if all_ranks:
        t = torch.tensor([dt], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dt = t.item()
    return dt


def run(cfg: DictConfig, device: torch.device) -> None:
    rank, world = rank_and_world()
    say = print if rank == 0 else (lambda *a, **k: None)
    B, S, Hq, Hkv, D = cfg.batch, cfg.seq_len, cfg.q_heads, cfg.kv_heads, cfg.head_dim
    q, k, v = synthetic_qkv(cfg, shard_chunks(S, world, rank, cfg.layout), device)
    flops = 4 * B * Hq * S * S * D * (0.5 if cfg.causal else 1.0)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"cpu ({torch.get_num_threads()} threads per rank)")
    say(f"ring prefill | {world} rank(s), {dist.get_backend()}, {where} | layout {cfg.layout}"
        f"{', causal' if cfg.causal else ''} | B={B} S={S} Hq/Hkv={Hq}/{Hkv} D={D} {cfg.dtype}")

    def ring():
        return ring_attention(q, k, v, causal=cfg.causal, layout=cfg.layout, return_lse=True)

    t_ring = seconds_per_call(ring, cfg, device, all_ranks=True)
    say(f"ring       {t_ring * 1e3:10.3f} ms/call  {flops / world / t_ring / 1e12:8.3f} TFLOPS per rank")
    if not cfg.compare or S > cfg.compare_max_len:
        say(f"one-device comparison skipped (compare={cfg.compare}, compare_max_len={cfg.compare_max_len})")
        return

    o_loc, lse_loc = ring()
    o = unshard_sequence(o_loc, None, cfg.layout)
    lse = unshard_sequence(lse_loc, None, cfg.layout, dim=-1)
    if rank == 0:
        chunks = sorted(c for r in range(world) for c in shard_chunks(S, world, r, cfg.layout))
        qf, kf, vf = synthetic_qkv(cfg, chunks, device)

        def one():
            return longctx.attention(qf, kf, vf, causal=cfg.causal, return_lse=True)

        try:
            t_one = seconds_per_call(one, cfg, device, all_ranks=False)
            o_ref, lse_ref = one()
        except torch.cuda.OutOfMemoryError:
            say("one device: out of memory for the full sequence; no comparison")
        else:
            say(f"one device {t_one * 1e3:10.3f} ms/call  {flops / t_one / 1e12:8.3f} TFLOPS "
                f"(longctx.attention, full sequence, rank 0's device)")
            say(f"parallel efficiency {100 * t_one / (world * t_ring):.0f}%  (t_1 / (W x t_W))")
            err_o = (o.float() - o_ref.float()).abs().max().item()
            err_lse = (lse.float() - lse_ref.float()).abs().max().item()
            say(f"max |O err| vs one device: {err_o:.2e}   max |LSE err|: {err_lse:.2e}")
    dist.barrier()


@hydra.main(config_path="../configs", config_name="prefill", version_base="1.3")
def main(cfg: DictConfig) -> None:
    device = init_from_env()
    try:
        run(cfg, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
