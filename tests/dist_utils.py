"""Run a function in W spawned processes joined in a gloo process group (CPU distributed tests)."""

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


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world: int, *args) -> None:
    """Call fn(rank, world, *args) on `world` gloo ranks; a failure on any rank fails the caller.

    fn must be a module-level function (it is pickled into the spawned processes).
    """
    mp.spawn(_entry, args=(world, _free_port(), fn, args), nprocs=world, join=True)
