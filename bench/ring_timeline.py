"""Where a multi-GPU ring prefill's time goes: a per-step kernel timeline of every rank, and what
running beside the transfers and beside the other GPUs costs the attention kernel.

    torchrun --nproc_per_node=4 bench/ring_timeline.py --seq-len 131072 [--heads 32 32] \
        [--out timeline.json]

1. Timeline: one `ring_attention` call (zigzag, causal, bf16) under the profiler on every rank.
   Per rank, each GPU kernel with its start (ms from the call's first kernel on any rank), its
   length and its stream: the attention calls of each step, the merges, NCCL's send/recv
   kernels; then the rank's compute busy time, the time its compute stream sat idle, and how
   much of NCCL's time overlapped compute.
2. Contention: one ring step's attention (the rank's step-1 blocks) timed (a) alone, (b) while
   NCCL sends this rank's K/V shard to the next rank and receives the previous one's, as the
   ring does, (c) while the copy engines push the shard into the next rank's symmetric-memory
   buffer (no SMs used), and (d) with only rank 0 computing while the other GPUs idle
   (power / clock effects of four busy GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from types import SimpleNamespace

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from longctx.attention import attention_merge_into
from longctx.parallel import init_from_env, ring_attention
from longctx.parallel.allreduce import enable_symmetric_memory
from longctx.parallel.ring import _step_blocks, shard_chunks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from prefill import synthetic_qkv  # noqa: E402


def kernels_of(prof) -> list[dict]:
    """GPU kernels and copies of a profile: name, start and end (µs, host clock), stream."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    out = []
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e:
            out.append(dict(name=e["name"], t0=float(e["ts"]), t1=float(e["ts"]) + float(e["dur"]),
                            stream=e.get("args", {}).get("stream", -1)))
    return sorted(out, key=lambda k: k["t0"])


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in a for y0, y1 in b)


def timed(fn, iters: int = 3) -> float:
    """ms per call of fn on this rank's current stream (CUDA events), after one warm call."""
    fn()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(iters):
        fn()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--heads", type=int, nargs=2, default=[32, 32], help="query heads, KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--transport", default="auto", help="ring_attention's transport")
    ap.add_argument("--out", default=None, help="JSON file for every rank's kernels and timings")
    args = ap.parse_args()
    device = init_from_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    S = args.seq_len
    cfg = SimpleNamespace(seed=0, dtype="bfloat16", batch=1, q_heads=args.heads[0],
                          kv_heads=args.heads[1], head_dim=args.head_dim)
    q_chunks = shard_chunks(S, world, rank, "zigzag")
    q, k, v = synthetic_qkv(cfg, q_chunks, device)

    def ring():
        return ring_attention(q, k, v, causal=True, layout="zigzag", transport=args.transport)

    ring()
    ring()
    torch.cuda.synchronize()
    dist.barrier()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    with prof:
        ring()
        torch.cuda.synchronize()
    ks = kernels_of(prof)
    dist.barrier()

    # 2. contention: this rank's step-1 blocks (K/V of rank r-1), merged into a float32 state
    k_chunks = shard_chunks(S, world, (rank - 1) % world, "zigzag")
    blocks = _step_blocks(q_chunks, k_chunks, True)
    o_acc = torch.zeros(*q.shape, dtype=torch.float32, device=device)
    lse_acc = torch.zeros(*q.shape[:3], dtype=torch.float32, device=device)

    def step():
        for b in blocks:
            attention_merge_into(o_acc[:, b.q0:b.q1], lse_acc[:, b.q0:b.q1], q[:, b.q0:b.q1],
                                 k[:, b.k0:b.k1], v[:, b.k0:b.k1], causal=b.masked,
                                 q_start=b.q_start, k_start=b.k_start)

    side = torch.cuda.Stream(device)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    kv_recv = [torch.empty_like(k), torch.empty_like(v)]

    def with_nccl():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ops = [dist.P2POp(dist.isend, t, nxt) for t in (k, v)]
            ops += [dist.P2POp(dist.irecv, t, prv) for t in kv_recv]
            works = dist.batch_isend_irecv(ops)
        step()
        with torch.cuda.stream(side):
            for w in works:
                w.wait()
        torch.cuda.current_stream().wait_stream(side)

    import torch.distributed._symmetric_memory as symm_mem
    enable_symmetric_memory(dist.group.WORLD)
    n = k.numel() + v.numel()
    sbuf = symm_mem.empty(n, dtype=k.dtype, device=device)
    handle = symm_mem.rendezvous(sbuf, dist.group.WORLD.group_name)
    peer = handle.get_buffer(nxt, (n,), k.dtype)
    kv_flat = torch.cat([k.reshape(-1), v.reshape(-1)])

    def with_copy_engine():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            peer.copy_(kv_flat)
        step()
        torch.cuda.current_stream().wait_stream(side)

    res = {}
    for name, fn in (("alone", step), ("beside NCCL send/recv", with_nccl),
                     ("beside copy-engine push", with_copy_engine)):
        dist.barrier()
        res[name] = timed(fn)
    transfer = {}  # the transfers alone, for reference

    def nccl_only():
        ops = [dist.P2POp(dist.isend, t, nxt) for t in (k, v)]
        ops += [dist.P2POp(dist.irecv, t, prv) for t in kv_recv]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    dist.barrier()
    transfer["NCCL send/recv"] = timed(nccl_only)
    dist.barrier()
    transfer["copy-engine push"] = timed(lambda: peer.copy_(kv_flat))
    dist.barrier()
    # (d) rank 0 alone while the other GPUs idle
    solo = timed(step) if rank == 0 else None
    dist.barrier()

    gathered = [None] * world
    dist.all_gather_object(gathered, dict(rank=rank, kernels=ks, step_ms=res, transfer_ms=transfer,
                                          solo_ms=solo, blocks=[vars(b) for b in blocks]))
    if rank == 0:
        report(gathered, args, torch.cuda.get_device_name(), k.numel() * 2 * k.element_size())
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(args=vars(args), device=torch.cuda.get_device_name(), ranks=gathered,
                               commit=os.environ.get("LONGCTX_COMMIT")), f)
    dist.barrier()
    dist.destroy_process_group()


def report(ranks: list[dict], args, device: str, shard_bytes: int) -> None:
    t_start = min(k["t0"] for r in ranks for k in r["kernels"])
    t_end = max(k["t1"] for r in ranks for k in r["kernels"])
    print(f"ring prefill timeline | {len(ranks)} x {device} | S={args.seq_len} "
          f"Hq/Hkv={args.heads[0]}/{args.heads[1]} D={args.head_dim} bf16 causal zigzag, "
          f"transport {args.transport} | "
          f"call {(t_end - t_start) / 1e3:.2f} ms (first kernel to last, all ranks)")
    for r in ranks:
        comm_names = ("nccl", "memcpy", "barrier", "ring_sync")
        comp = [k for k in r["kernels"] if not any(c in k["name"].lower() for c in comm_names)]
        comm = [k for k in r["kernels"] if any(c in k["name"].lower() for c in comm_names)]
        print(f"\nrank {r['rank']}: start ms  length ms  stream  kernel")
        for k in r["kernels"]:
            if k["t1"] - k["t0"] < 20 and k in comp:
                continue  # fills, casts: summed below
            print(f"  {(k['t0'] - t_start) / 1e3:9.3f}  {(k['t1'] - k['t0']) / 1e3:9.3f}  "
                  f"{k['stream']:>6}  {k['name'][:70]}")
        busy = sum(k["t1"] - k["t0"] for k in comp)
        small = sum(k["t1"] - k["t0"] for k in comp if k["t1"] - k["t0"] < 20)
        span = max(k["t1"] for k in comp) - min(k["t0"] for k in comp)
        ov = overlap([(k["t0"], k["t1"]) for k in comm], [(k["t0"], k["t1"]) for k in comp])
        print(f"  compute busy {busy / 1e3:.2f} ms (kernels < 20 µs: {small / 1e3:.3f} ms) of a "
              f"{span / 1e3:.2f} ms span: idle {100 * (1 - busy / span):.1f}%; transfers and barriers "
              f"{sum(k['t1'] - k['t0'] for k in comm) / 1e3:.2f} ms, {ov / 1e3:.2f} ms beside compute; "
              f"ends {(max(k['t1'] for k in r['kernels']) - t_start) / 1e3:.2f} ms")
    print(f"\none ring step's attention (step-1 blocks), ms: shard {shard_bytes / 1e6:.0f} MB")
    names = list(ranks[0]["step_ms"])
    print("  rank  " + "  ".join(f"{n:>24}" for n in names) + f"  {'rank 0, others idle':>20}"
          + "  " + "  ".join(f"{n:>18}" for n in ranks[0]["transfer_ms"]))
    for r in ranks:
        solo = f"{r['solo_ms']:20.3f}" if r["solo_ms"] is not None else " " * 20
        print(f"  {r['rank']:>4}  " + "  ".join(f"{r['step_ms'][n]:24.3f}" for n in names) + "  "
              + solo + "  " + "  ".join(f"{t:18.3f}" for t in r["transfer_ms"].values()))


if __name__ == "__main__":
    main()
