"""Small helpers shared by the kernels' launch wrappers."""

from __future__ import annotations

import functools

import torch
import triton

from longctx.backend import interpreter_active


def autotune_configs(configs: list[triton.Config]) -> list[triton.Config]:
    """The autotune search space; one config under the interpreter (several crash it)."""
    return configs[:1] if interpreter_active() else configs


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached; no sync)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """SM count of `device`; a nominal 132 (an H100) for CPU tensors under the interpreter."""
    if device.type != "cuda":
        return 132
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())
