"""Ring-attention prefill of a synthetic context over all ranks, timed against one device.

    torchrun --nproc_per_node=8 launch/prefill.py seq_len=65536 q_heads=32 kv_heads=8 \
        head_dim=128 dtype=bfloat16          # one GPU per rank (nccl, device = LOCAL_RANK)
    torchrun --nproc_per_node=2 launch/prefill.py   # CPU: gloo, the small defaults
    python launch/prefill.py                 # one rank

Each rank builds only its own shard (in `layout`) of a random q/k/v sequence and runs
`ring_attention`. Rank 0 prints the time per call (slowest rank), TFLOPS per rank (causal FLOPs
halved), and, when the sequence fits on one device, the same kernel (`longctx.attention`) on the
full sequence there: its time, the parallel efficiency t_1 / (W x t_W), and the ring output's
max error against it.

`peers=[cp_cudnn,cp_flash]` also times torch's context parallelism
(torch.distributed.tensor.experimental.context_parallel: ring attention over SDPA with head-tail
load balancing) with SDPA's cuDNN or flash backend, in the same run, with its own one-device
SDPA time for its efficiency.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
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
        f"{', causal' if cfg.causal else ''}, transport {cfg.transport} | B={B} S={S} "
        f"Hq/Hkv={Hq}/{Hkv} D={D} {cfg.dtype}")

    def ring():
        return ring_attention(q, k, v, causal=cfg.causal, layout=cfg.layout, return_lse=True,
                              transport=cfg.transport)

    t_ring = seconds_per_call(ring, cfg, device, all_ranks=True)
    say(f"ring       {t_ring * 1e3:10.3f} ms/call  {flops / world / t_ring / 1e12:8.3f} TFLOPS per rank")
    if cfg.compare and S <= cfg.compare_max_len:
        compare_one_device(cfg, device, ring, flops, t_ring)
    else:
        say(f"one-device comparison skipped (compare={cfg.compare}, compare_max_len={cfg.compare_max_len})")
    for peer in cfg.peers:
        torch_context_parallel(cfg, device, peer, flops)


def compare_one_device(cfg: DictConfig, device: torch.device, ring: Callable, flops: float,
                       t_ring: float) -> None:
    """Rank 0 runs longctx.attention on the full sequence: its time, the ring's parallel
    efficiency, and the ring output's max error against it."""
    rank, world = rank_and_world()
    say = print if rank == 0 else (lambda *a, **k: None)
    S = cfg.seq_len
    o_loc, lse_loc = ring()
    o = unshard_sequence(o_loc, None, cfg.layout)
    lse = unshard_sequence(lse_loc, None, cfg.layout)
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
            # CPU ranks are processes sharing one machine's cores and memory
            note = "" if device.type == "cuda" else "; CPU ranks share the cores: not scaling"
            eff = 100 * t_one / (world * t_ring)
            say(f"parallel efficiency {eff:.0f}%  (t_1 / (W x t_W){note})")
            err_o = (o.float() - o_ref.float()).abs().max().item()
            err_lse = (lse.float() - lse_ref.float()).abs().max().item()
            say(f"max |O err| vs one device: {err_o:.2e}   max |LSE err|: {err_lse:.2e}")
    dist.barrier()


CP_BACKENDS = ("cp_cudnn", "cp_flash")


def torch_context_parallel(cfg: DictConfig, device: torch.device, peer: str, flops: float) -> None:
    """Time torch's context parallelism (SDPA backend `peer`) on the same sequence; rank 0
    prints ms/call, TFLOPS per rank, and the efficiency against that backend on one device."""
    if peer not in CP_BACKENDS:
        raise ValueError(f"peers: unknown peer {peer!r}; choose from {CP_BACKENDS}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rank, world = rank_and_world()
    say = print if rank == 0 else (lambda *a, **k: None)
    backend = {"cp_cudnn": SDPBackend.CUDNN_ATTENTION, "cp_flash": SDPBackend.FLASH_ATTENTION}[peer]
    # The whole sequence on every rank in SDPA's [B, H, S, D] layout (context_parallel shards
    # it); K/V heads repeated for GQA, which torch's ring attention does not take.
    q, k, v = synthetic_qkv(cfg, [(0, cfg.seq_len)], device)
    rep = cfg.q_heads // cfg.kv_heads
    q, k, v = (x.transpose(1, 2).contiguous() for x in
               (q, k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)))
    with sdpa_kernel(backend):
        t_one = None
        if rank == 0 and cfg.compare and cfg.seq_len <= cfg.compare_max_len:
            t_one = seconds_per_call(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=cfg.causal),
                cfg, device, all_ranks=False)
        dist.barrier()
        mesh = init_device_mesh(device.type, (world,))
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2],
                              no_restore_buffers={q, k, v}):
            t_cp = seconds_per_call(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=cfg.causal),
                cfg, device, all_ranks=True)
    line = f"torch CP {peer[3:]:<6} {t_cp * 1e3:8.3f} ms/call  {flops / world / t_cp / 1e12:8.3f} TFLOPS per rank"
    if t_one is not None:
        line += f"  (one device {t_one * 1e3:.3f} ms: efficiency {100 * t_one / (world * t_cp):.0f}%)"
    say(line)


@hydra.main(config_path="../configs", config_name="prefill", version_base="1.3")
def main(cfg: DictConfig) -> None:
    device = init_from_env()
    try:
        run(cfg, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
