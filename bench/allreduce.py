"""Latency of the small all-reduces of tensor-parallel decoding (one [1, dim] bf16 row per
o_proj and down_proj: 96 per CodeLlama-34B token) through NCCL and through torch's
symmetric-memory one-shot kernel (peer-to-peer loads; no NVLink multicast).

    torchrun --nproc_per_node=2 bench/allreduce.py [--numel 8192] [--chain 96]

Each variant is timed as a chain of `chain` all-reduces captured in one CUDA graph, as in a
decode step; the result is checked against the expected sum first.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def graph_us(fn, chain: int, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
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
    p.add_argument("--numel", type=int, default=8192)
    p.add_argument("--chain", type=int, default=96)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    group = dist.group.WORLD
    x = torch.full((a.numel,), float(rank + 1), device="cuda", dtype=torch.bfloat16)
    want = world * (world + 1) / 2
    rows = []

    def nccl():
        dist.all_reduce(x)

    y = x.clone()
    dist.all_reduce(y)
    assert torch.all(y == want), "nccl sum"
    rows.append(("NCCL all_reduce", graph_us(nccl, a.chain)))

    try:
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group.group_name)
        buf = symm_mem.empty(a.numel, device="cuda", dtype=torch.bfloat16)
        symm_mem.rendezvous(buf, group.group_name)
        buf.fill_(rank + 1)
        out = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group.group_name)
        torch.cuda.synchronize()
        assert torch.all(out == want), f"one-shot sum {out[:4]}"
        rows.append(("symm_mem one_shot", graph_us(
            lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group.group_name), a.chain)))
        out2 = torch.empty_like(buf)
        rows.append(("symm_mem one_shot_out", graph_us(
            lambda: torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", group.group_name, out2),
            a.chain)))
        buf.fill_(rank + 1)
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group.group_name)
        torch.cuda.synchronize()
        assert torch.all(buf == want), f"two-shot sum {buf[:4]}"
        rows.append(("symm_mem two_shot_", graph_us(
            lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group.group_name), a.chain)))
    except Exception as e:  # report, keep the NCCL row
        rows.append((f"symm_mem failed: {type(e).__name__}: {str(e)[:200]}", float("nan")))

    if rank == 0:
        print(f"{torch.cuda.get_device_name()} x{world}, {a.numel} bf16 ({a.numel * 2} B), "
              f"chain of {a.chain} in one CUDA graph")
        for name, us in rows:
            print(f"  {name:<28} {us:7.2f} µs per all-reduce")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
