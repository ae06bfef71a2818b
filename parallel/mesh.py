"""The decode mesh: world = tp x sp ranks (torchrun's environment), validated up front."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from longctx.config import ModelArgs


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees of a decode run, checked on construction (ValueError states the numbers).

    tp: tensor parallelism (heads, MLP and vocabulary sharded); sp: sequence parallelism (each
    sequence's KV cache sharded by position). Ranks are laid out sp-major, rank = sp_rank * tp +
    tp_rank, so a tensor-parallel group is tp neighbouring GPUs.
    """

    tp: int
    sp: int
    world_size: int

    def __post_init__(self) -> None:
        for name, v in (("parallel.tp", self.tp), ("parallel.sp", self.sp)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.tp * self.sp != self.world_size:
            raise ValueError(
                f"parallel.tp ({self.tp}) x parallel.sp ({self.sp}) = {self.tp * self.sp} must "
                f"equal the world size ({self.world_size}, torchrun's --nproc_per_node x nodes)")

    @classmethod
    def from_env(cls, tp: int, sp: int) -> "ParallelDims":
        """World size from the initialised process group, else torchrun's WORLD_SIZE, else 1."""
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        return cls(tp, sp, world)

    def check_model(self, args: ModelArgs) -> None:
        """The model's sizes must split tp ways."""
        tp = self.tp
        for field in ("n_heads", "intermediate_size", "vocab_size"):
            if getattr(args, field) % tp:
                raise ValueError(f"model.{field} ({getattr(args, field)}) must be divisible by "
                                 f"parallel.tp ({tp})")
        if args.n_kv_heads % tp and tp % args.n_kv_heads:
            raise ValueError(
                f"parallel.tp ({tp}) must divide model.n_kv_heads ({args.n_kv_heads}) or be a "
                "multiple of it (then each KV head is replicated on tp / n_kv_heads ranks)")

    def local_kv_heads(self, args: ModelArgs) -> int:
        """KV heads per rank: a tp-th of them, or one (replicated) when tp exceeds their count."""
        return max(args.n_kv_heads // self.tp, 1)

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The 2-D ("sp", "tp") device mesh over the initialised world; None for one process."""
        if self.world_size == 1:
            return None
        return init_device_mesh(device_type, (self.sp, self.tp), mesh_dim_names=("sp", "tp"))
