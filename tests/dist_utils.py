"""Run a function in W spawned processes joined in a process group: gloo for the CPU tests, nccl
(one GPU per rank) for the multi-GPU ones. A rank that has not finished within `timeout` seconds
prints the stack of every thread and exits, so a hang (a collective one rank never joins, a spin
on a flag no peer sets) fails its test where it hangs instead of stalling the suite."""

from __future__ import annotations

import faulthandler
import os
import socket
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

# Seconds a rank may run: the slowest multi-process test takes ~30 s on 2 cores (the interpreter
# process's sp=2 model on the kernels); a hang, however long, costs this much.
TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple,
           timeout: float) -> None:
    # Past the deadline: every thread's stack to stderr (the test's captured output), then
    # exit(1), which makes mp.spawn stop the other ranks and raise in the test.
    faulthandler.dump_traceback_later(timeout, exit=True)
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
        faulthandler.cancel_dump_traceback_later()


def run_distributed(fn: Callable, world: int, *args, backend: str = "gloo",
                    timeout: float = TIMEOUT_S) -> None:
    """Call fn(rank, world, *args) on `world` ranks (gloo, or nccl with GPU `rank` each); a
    failure on any rank fails the caller, and so does a rank still running after `timeout`
    seconds (its threads' stacks printed first).

    fn must be a module-level function (it is pickled into the spawned processes).
    """
    mp.spawn(_entry, args=(world, _free_port(), backend, fn, args, timeout), nprocs=world,
             join=True)
