"""Backend choice: CUDA tensors run the Triton kernels, CPU tensors the torch reference.

Tests force the Triton kernels onto CPU tensors (under the Triton interpreter, which
tests/conftest.py enables when there is no GPU) with `force_triton()`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

_forced = False


def interpreter_active() -> bool:
    """True when Triton runs kernels in its Python interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@contextlib.contextmanager
def force_triton(enabled: bool = True) -> Iterator[None]:
    """Route CPU tensors to the Triton kernels too (needs TRITON_INTERPRET=1 on CPU)."""
    global _forced
    if enabled and not interpreter_active() and not torch.cuda.is_available():
        raise RuntimeError("force_triton() on a machine without CUDA needs TRITON_INTERPRET=1")
    prev, _forced = _forced, enabled
    try:
        yield
    finally:
        _forced = prev


def use_triton_for(t: torch.Tensor) -> bool:
    """Whether work on tensor `t` goes to the Triton kernels (CUDA, or forced)."""
    return t.is_cuda or _forced
