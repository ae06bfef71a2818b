"""Latency of tensor-parallel decoding's sums: NCCL, torch's symmetric-memory one-shot kernel and
longctx's push kernel (kernels/allreduce.py), plain and fused with the residual add + RMSNorm,
at 16 KiB (one bf16 row of 8192: batch 1) and at batch 8 (8 rows, 128 KiB); then each behind a
GEMV, as in a decode step: o_proj-shaped GEMVs ([8192, 8192 / W]) each followed by the sum and
the norm, against the GEMVs alone (the difference is the time the sums add to a step).

    torchrun --nproc_per_node=2 bench/allreduce.py [--chain 96] [--out result.json]
                                                   [--warps 8 32] [--early]

--warps adds the push kernel at those warps per row beside its rule's (16 at 8192 columns);
--early the pushing GEMV with the push kernel's other release point (after the peers' data is in;
parallel/allreduce.py PushAllReduce's `early`).

Each variant is a chain of `chain` calls captured in one CUDA graph (a decode step makes 96 at
CodeLlama-34B), replayed `reps` times after a barrier; the median replay over `chain` is
reported. Every variant's result is checked against the expected sum first.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from longctx.kernels.gemv import gemv
from longctx.parallel.allreduce import NcclAllReduce, PushAllReduce, enable_symmetric_memory

DIM = 8192


class TorchOneShot(NcclAllReduce):
    """The peer: torch's symmetric-memory one-shot kernel (copy in, barrier, peer loads,
    barrier), then longctx's norm kernel; two buffers alternate (a rank may write the next
    call's buffer while a peer still reads this one's)."""

    name = "torch one-shot"

    def __init__(self, group, device: torch.device, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        super().__init__(group)
        enable_symmetric_memory(group)
        self.bufs = [symm_mem.empty(16 * DIM, dtype=dtype, device=device) for _ in range(2)]
        for b in self.bufs:
            symm_mem.rendezvous(b, group.group_name)
        self.calls = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.bufs[self.calls % 2]
        self.calls += 1
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf[:x.numel()], x.view(-1), "sum",
                                                       self.group.group_name, out.view(-1))
        return out


def graph_us(fn, chain: int, reps: int = 20) -> float:
    """Median µs per call of `fn` in a CUDA graph of `chain` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(chain):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / chain)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--chain", type=int, default=96)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--out", default=None)
    p.add_argument("--warps", type=int, nargs="*", default=[],
                   help="the push kernel also at these warps per row")
    p.add_argument("--early", action="store_true",
                   help="also the pushing GEMV with the push kernel's other release point "
                        "(late, after the peers' data is in, beside the default early one)")
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group, dt = dist.group.WORLD, torch.bfloat16
    comms = {"NCCL": NcclAllReduce(group),
             "torch one-shot": TorchOneShot(group, device, dt),
             "longctx push": PushAllReduce.symmetric(group, device, dt, DIM)}
    for nw in a.warps:
        comms[f"push, {nw} warps"] = PushAllReduce.symmetric(group, device, dt, DIM, num_warps=nw)
    weight = torch.ones(DIM, device=device, dtype=dt)
    want = world * (world + 1) / 2
    rows = []
    for M in a.rows:
        for name, comm in comms.items():
            x = torch.full((M, DIM), float(rank + 1), device=device, dtype=dt)
            res = torch.zeros_like(x)
            got = comm.all_reduce(x.clone())
            assert torch.all(got == want), f"{name}: sum {got.flatten()[:4]}"
            s, _ = comm.add_rms_norm(res, x.clone(), weight, 1e-5)
            assert torch.all(s == want), f"{name} + norm: sum {s.flatten()[:4]}"
            # (NCCL sums x in place: the values grow, the time does not change.)
            plain = graph_us(lambda: comm.all_reduce(x), a.chain)
            fused = graph_us(lambda: comm.add_rms_norm(res, x, weight, 1e-5), a.chain)
            rows.append({"rows": M, "bytes": M * DIM * 2, "variant": name, "sum_us": plain,
                         "sum_norm_us": fused})
    # Behind a GEMV (batch 1): the o_proj shape of tensor parallelism over `world` ranks; two
    # weights alternate so that none is read from L2.
    K = DIM // world
    ws = [torch.randn(DIM, K, device=device, dtype=dt) / K ** 0.5 for _ in range(2)]
    h = torch.randn(1, K, device=device, dtype=dt)
    res = torch.randn(1, DIM, device=device, dtype=dt)
    i = [0]

    def w():
        i[0] += 1
        return ws[i[0] % 2]

    push = comms["longctx push"]
    layer = {
        "GEMV alone": lambda: gemv(h, w()),
        "GEMV + NCCL + norm": lambda: comms["NCCL"].add_rms_norm(res, gemv(h, w()), weight, 1e-5),
        "GEMV + torch one-shot + norm": lambda: comms["torch one-shot"].add_rms_norm(
            res, gemv(h, w()), weight, 1e-5),
        "GEMV + push fused": lambda: push.add_rms_norm(res, gemv(h, w()), weight, 1e-5),
        "GEMV pushing + fused": lambda: push.add_rms_norm(
            res, gemv(h, w(), push=push.bufs), weight, 1e-5,
            pushed=True),
    }
    for nw in a.warps:
        comm = comms[f"push, {nw} warps"]
        layer[f"GEMV pushing + fused, {nw} warps"] = lambda comm=comm: comm.add_rms_norm(
            res, gemv(h, w(), push=comm.bufs), weight, 1e-5, pushed=True)
    if a.early:
        other = not push.early
        comm = PushAllReduce.symmetric(group, device, dt, DIM, early=other)
        layer[f"GEMV pushing + fused, {'early' if other else 'late'}"] = lambda: \
            comm.add_rms_norm(res, gemv(h, w(), push=comm.bufs), weight, 1e-5, pushed=True)
    gemv_rows = {name: graph_us(fn, a.chain) for name, fn in layer.items()}
    if rank == 0:
        print(f"{torch.cuda.get_device_name()} x{world}, bf16, chains of {a.chain} calls in one "
              f"CUDA graph; µs per call (median of 20 replays)")
        print(f"{'variant':<18}" + "".join(f" | {m} row{'s' * (m > 1)}: sum, +norm" for m in a.rows))
        for name in comms:
            cells = [r for r in rows if r["variant"] == name]
            print(f"{name:<18}" + "".join(f" | {c['sum_us']:8.2f} {c['sum_norm_us']:8.2f}"
                                          for c in cells))
        base = gemv_rows["GEMV alone"]
        print(f"\nbatch 1, GEMV [{DIM}, {K}] then the sum and norm: µs per layer-half "
              f"(added to the GEMV alone)")
        for name, us in gemv_rows.items():
            print(f"  {name:<34} {us:8.2f}  (+{us - base:5.2f})")
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "world": world,
                           "chain": a.chain, "collectives": rows, "behind_gemv_us": gemv_rows},
                          f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
