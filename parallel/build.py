"""Build a model for a mesh: on the meta device, parallelised, then allocated and filled on its
device (each rank only its shards), with its KV caches. The one place the pieces are composed."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from longctx.config import ModelArgs
from longctx.model import Transformer
from longctx.parallel.sequence_parallel import apply_sequence_parallel
from longctx.parallel.tensor_parallel import apply_tensor_parallel
from longctx.weights import ShardPlan, WeightSource, load_weights


def build_model(args: ModelArgs, *, weights: WeightSource, device: torch.device | str,
                dtype: torch.dtype, batch: int, max_seq_len: int,
                mesh: DeviceMesh | None = None, all_reduce: str = "auto",
                kv_cache_dtype: torch.dtype | None = None, kv_smoothing: bool = True) -> Transformer:
    """A ready-to-run Transformer: weights in `dtype` on `device`, KV caches for `batch`
    sequences of up to `max_seq_len` positions. With a ("sp", "tp") mesh (ParallelDims.build_mesh)
    its tensor and sequence parallelism are applied before any weight is allocated; `all_reduce`
    picks tensor parallelism's sums (longctx.parallel.allreduce.make_all_reduce);
    `kv_cache_dtype` the KV cache's dtype (None: `dtype`; torch.float8_e4m3fn: fp8 with scales,
    smoothed unless `kv_smoothing` is False: Transformer.setup_caches)."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to(dtype)
    plan: ShardPlan = {}
    if mesh is not None and mesh["tp"].size() > 1:
        plan = apply_tensor_parallel(model, mesh.get_group("tp"), torch.device(device), dtype,
                                     all_reduce)
    if mesh is not None and mesh["sp"].size() > 1:
        apply_sequence_parallel(model, mesh.get_group("sp"))
    model.to_empty(device=device)
    load_weights(model, weights, plan)
    model.requires_grad_(False).eval()
    model.setup_caches(batch, max_seq_len, kv_cache_dtype, kv_smoothing)
    return model
