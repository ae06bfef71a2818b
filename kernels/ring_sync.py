"""The copy-engine ring's flags (parallel/ring.py): one tiny kernel between two attention steps.

Each rank's flags are 4 int32 counters in its torch-symmetric-memory buffer, written by its ring
neighbours: ARRIVED[slot] (by the previous rank: how many of its pushes into that receive slot
have landed) and FREE[slot] (by the next rank: how many times it has finished reading its own
receive slot, which this rank pushes into). Counters only grow, so nothing is ever reset.

The kernel runs on the compute stream between attention kernels, where every SM is free: a
wait on the side stream that carries the copies would sit behind the attention kernel's last
wave (bench/ring_timeline.py showed symmetric-memory barriers there starting only when the
attention kernel ended).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longctx.kernels.utils import FP_FUSION

ARRIVED, FREE = 0, 2  # offsets of the two counter pairs in a rank's flags


@triton.jit
def _read(ptr):
    return tl.atomic_add(ptr, 0, sem="acquire", scope="sys")


@triton.jit
def _ring_sync_kernel(MINE, NEXT, PREV, arrive_slot, arrive_val, free_slot, free_val,
                      wait_arrived_slot, wait_arrived_val, wait_free_slot, wait_free_val,
                      SIGNAL_ARRIVED: tl.constexpr, SIGNAL_FREE: tl.constexpr,
                      WAIT_ARRIVED: tl.constexpr, WAIT_FREE: tl.constexpr):
    # Release stores: what this stream did before (a copy into NEXT's buffer, an attention
    # kernel's reads of this rank's buffer) is ordered before the peer can see the count.
    if SIGNAL_ARRIVED:
        tl.atomic_xchg(NEXT + 0 + arrive_slot, arrive_val, sem="release", scope="sys")
    if SIGNAL_FREE:
        tl.atomic_xchg(PREV + 2 + free_slot, free_val, sem="release", scope="sys")
    if WAIT_ARRIVED:
        while _read(MINE + 0 + wait_arrived_slot) < wait_arrived_val:
            pass
    if WAIT_FREE:
        while _read(MINE + 2 + wait_free_slot) < wait_free_val:
            pass


def ring_sync(mine: torch.Tensor, nxt: torch.Tensor, prev: torch.Tensor,
              arrived: tuple[int, int] | None = None, free: tuple[int, int] | None = None,
              wait_arrived: tuple[int, int] | None = None,
              wait_free: tuple[int, int] | None = None) -> None:
    """On the current stream, in this order: set the next rank's ARRIVED[slot] = count
    (`arrived` = (slot, count)), set the previous rank's FREE[slot] = count (`free`), then wait
    until this rank's ARRIVED[slot] >= count (`wait_arrived`) and FREE[slot] >= count
    (`wait_free`). mine / nxt / prev: int32 [4] flags of this rank and the peer-mapped flags of
    the next and previous ranks."""
    a, f, wa, wf = (x or (0, 0) for x in (arrived, free, wait_arrived, wait_free))
    _ring_sync_kernel[(1,)](mine, nxt, prev, a[0], a[1], f[0], f[1], wa[0], wa[1], wf[0], wf[1],
                            SIGNAL_ARRIVED=arrived is not None, SIGNAL_FREE=free is not None,
                            WAIT_ARRIVED=wait_arrived is not None, WAIT_FREE=wait_free is not None,
                            num_warps=1, **FP_FUSION)
