"""Backend choice: CUDA tensors run the Triton kernels, CPU tensors the torch reference.

Under the Triton interpreter (TRITON_INTERPRET=1) tests force the Triton kernels onto CPU
tensors with `force_triton()`; nowhere else can a Triton kernel read host memory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

# Read once, at import: Triton decides when a kernel is defined (@triton.jit) whether it is
# compiled or interpreted, so a later change of the variable could not take effect.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_forced = False


def interpreter_active() -> bool:
    """True when Triton runs kernels in its Python interpreter (TRITON_INTERPRET=1 at import)."""
    return INTERPRET


@contextlib.contextmanager
def force_triton(enabled: bool = True) -> Iterator[None]:
    """Route CPU tensors to the Triton kernels too: only under the Triton interpreter, the one
    place a Triton kernel can read host memory (compiled kernels would get host pointers)."""
    global _forced
    if enabled and not INTERPRET:
        raise RuntimeError("force_triton() runs the Triton kernels on CPU tensors, which only the "
                           "Triton interpreter can do: set TRITON_INTERPRET=1 before importing "
                           "longctx (CUDA tensors take the kernels without it)")
    prev, _forced = _forced, enabled
    try:
        yield
    finally:
        _forced = prev


def use_triton_for(t: torch.Tensor) -> bool:
    """Whether work on tensor `t` goes to the Triton kernels (CUDA, or forced); False for what is
    not a tensor, which the caller's validation then rejects."""
    try:
        return t.is_cuda or _forced
    except AttributeError:
        return False
