"""Small helpers shared by the kernels' launch wrappers."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host-side ints. triton.cdiv / triton.next_power_of_2 are constexpr
    functions that cost ~5 µs per host call (argument unwrapping); a decode call used six."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n for host-side ints n >= 1 (0 for 0, as triton's)."""
    return n if n <= 1 else 1 << (n - 1).bit_length()


def head_tiles(head_dim: int, split: bool = True) -> tuple[int, int]:
    """(BLOCK_D, D_HI): a head's columns as the attention kernels tile them (Gluon tensors and
    Triton blocks are powers of two). A power of two is one tile (D_HI = 0). With `split`, a
    head_dim whose rest above the largest power of two below it is a power of two >= 16 (an MMA's
    K step) runs as those two tiles: 192 = 128 + 64, 160 = 128 + 32, 96 = 64 + 32, 80 = 64 + 16,
    48 = 32 + 16 (no padding); any other (40, 56, 72, 88, ...) as one tile of the next power of
    two whose columns past head_dim are zero (D_HI = 0)."""
    tile = next_power_of_2(head_dim)
    rest = head_dim - tile // 2
    if split and tile != head_dim and rest >= 16 and rest == next_power_of_2(rest):
        return tile // 2, rest
    return tile, 0


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached; no sync)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device ("cuda" without one: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def device_sms(device: torch.device) -> int:
    """SM count of `device`; a nominal 132 (an H100) for CPU tensors under the interpreter."""
    if device.type != "cuda":
        return 132
    return num_sms(cuda_index(device))


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability of a CUDA device (cached; no sync); None for other devices."""
    return _capability(cuda_index(device)) if device.type == "cuda" else None


@functools.lru_cache(maxsize=None)
def _device_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


def device_name(device: torch.device) -> str:
    """Name of a CUDA device (cached; no sync); "" for other devices."""
    return _device_name(cuda_index(device)) if device.type == "cuda" else ""


# Fusing a * b + c into one FMA, said at every launch: the kernels were tested and timed with
# it (Triton 3.6's default). Triton 3.9 warns at the first compile that leaves it unsaid, and
# 3.10 turns its default off (TRITON_DEFAULT_FP_FUSION, which then no longer moves longctx).
FP_FUSION = {"enable_fp_fusion": True}

_pdl_off = False


@contextlib.contextmanager
def pdl_off() -> Iterator[None]:
    """Launch without PDL inside the block: for per-kernel profiles (with PDL a kernel starts
    early, and its device time includes waiting for its predecessor)."""
    global _pdl_off
    prev, _pdl_off = _pdl_off, True
    try:
        yield
    finally:
        _pdl_off = prev


def _has_pdl(device_index: int) -> bool:
    return _capability(device_index)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """Launch arguments for programmatic dependent launch (PDL, Hopper and later).

    A decode step at batch 1 is a chain of a dozen short kernels per layer; launched with PDL a
    kernel is scheduled while its predecessor still runs (once every program of the predecessor
    has passed its own `pdl_wait`), so its launch latency and its prologue (the GEMV's first
    weight tile) overlap the predecessor's work. Every kernel launched so must call `pdl_wait`
    in every program before it touches memory written by earlier work or writes anything: that
    wait returns once the predecessor has completed and its writes are visible. Loads of data
    no kernel writes (weights) may come before it.

    Returns {"USE_PDL": True, "launch_pdl": True} on sm_90+ GPUs, else {"USE_PDL": False}
    (CPU and the interpreter, older GPUs, LONGCTX_PDL=0 in the environment at import, or inside
    `pdl_off()`), each with `FP_FUSION`: the launch options of every kernel that takes these.
    """
    if device.type != "cuda" or not pdl_allowed() or not _has_pdl(cuda_index(device)):
        return {**FP_FUSION, "USE_PDL": False}
    return {**FP_FUSION, "USE_PDL": True, "launch_pdl": True}


# LONGCTX_PDL, read once at import: reading the environment costs ~0.5 µs, a tenth of an eager
# call's Python, and the plan caches read `pdl_allowed` on every call.
_PDL_ENV = os.environ.get("LONGCTX_PDL", "1") != "0"


def pdl_allowed() -> bool:
    """False inside `pdl_off()` or with LONGCTX_PDL=0 in the environment at import. With the
    device it is all `pdl_launch` depends on: plan caches key by it."""
    return _PDL_ENV and not _pdl_off


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """With PDL: wait until the preceding kernel has completed and its writes are visible, then
    let the next kernel launch (its programs get scheduled and sit in their own wait). A no-op
    without.

    This early trigger once looked unsafe: the ring's attention -> merge_into sequence gave
    different results from run to run with it. The cause was merge_into's in-place update, whose
    late warps could read the LSE that a faster warp had already overwritten (kernels/merge.py);
    co-resident programs of the next kernel made such skew likely. tests/test_merge_gpu.py and
    tests/test_ring_gpu.py check it.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
