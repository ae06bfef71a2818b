"""Process groups: joining one from torchrun's environment, and the group queries parallel code shares."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["init_from_env", "rank_and_world", "global_rank", "all_gather_ints"]


def init_from_env() -> torch.device:
    """Join the default process group described by torchrun's environment; return this rank's device.

    CUDA: backend nccl, device cuda:LOCAL_RANK (made current). CPU: backend gloo. Without
    torchrun's variables (plain `python`), a one-rank group on an in-memory store. If the default
    group already exists it is kept.
    """
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)  # env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def rank_and_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank in `group`, size of `group`); (0, 1) when no process group is initialised."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank (what P2P ops address) of rank `group_rank` of `group` (None: the world)."""
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_rank)


def all_gather_ints(
    values: list[int], group: dist.ProcessGroup | None, device: torch.device
) -> list[list[int]]:
    """Every rank's `values` (the same count on every rank), indexed by group rank.

    For cross-rank consistency checks before communication that would hang or corrupt data on a
    mismatch. One small collective on `device` (the group's backend must support it: CUDA for
    nccl, CPU for gloo); a host synchronisation on CUDA.
    """
    _, world = rank_and_world(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = torch.empty(world * len(values), dtype=torch.int64, device=device)
    # all_gather_single is the newer name; recent torch deprecates all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine, group=group)
    return out.view(world, len(values)).tolist()
