"""Run a function in W spawned processes joined in a process group: gloo for the CPU tests, nccl
(one GPU per rank) for the multi-GPU ones."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if backend == "nccl":
        import torch

        torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world: int, *args, backend: str = "gloo") -> None:
    """Call fn(rank, world, *args) on `world` ranks (gloo, or nccl with GPU `rank` each); a
    failure on any rank fails the caller.

    fn must be a module-level function (it is pickled into the spawned processes).
    """
    mp.spawn(_entry, args=(world, _free_port(), backend, fn, args), nprocs=world, join=True)
