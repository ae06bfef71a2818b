"""Split-KV decode sized for a tensor-parallel rank's own KV heads: one full wave of programs on
each rank's GPU. The launch grid comes from the decode plan that the model's decode
step builds (longctx.kernels.decode.DecodePlan), for CodeLlama-34B's 8 KV heads split over
tp = 1, 2, 4, 8 ranks (8, 4, 2, 1 per rank) and replicated at tp = 16 (1 per rank)."""

import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import longctx.kernels.decode as kd
from longctx.backend import force_triton
from longctx.config import ModelArgs
from longctx.parallel.mesh import ParallelDims
from tests.dist_utils import run_distributed
from tests.test_model_parallel import BATCH, _build, tiny

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMS = 132  # an H100 / H200
GEN = OmegaConf.load(CONFIGS / "decode.yaml").gen_len  # the cache holds context + GEN positions
MIN_KEYS = inspect.signature(kd.choose_num_splits).parameters["min_keys_per_split"].default


def codellama_34b() -> ModelArgs:
    return ModelArgs.from_config(OmegaConf.load(CONFIGS / "model" / "codellama34b.yaml"))


def rank_grid(args: ModelArgs, tp: int, batch: int, context: int) -> tuple[int, tuple]:
    """(num_splits, split-kernel grid) of a tp rank's decode plan: q [B, Hq/tp, D] over its
    cache [B, context + GEN, local KV heads, D] bf16 (a stride-0 view: only shapes are read)."""
    hq, hkv = args.n_heads // tp, ParallelDims(tp, 1, tp).local_kv_heads(args)
    q = torch.empty(batch, hq, args.head_dim, dtype=torch.bfloat16)
    cache = torch.empty(batch, 1, hkv, args.head_dim, dtype=torch.bfloat16).expand(
        batch, context + GEN, hkv, args.head_dim)
    plan = kd.DecodePlan(q, cache, cache, torch.zeros(batch, dtype=torch.int32), None,
                         args.head_dim ** -0.5, None, False)
    return plan.num_splits, plan.split.grid


def test_one_wave_per_tp_rank():
    """Programs = splits x B x local KV heads (x query-head blocks, 1 here) fill at most one wave
    of the SMs, and at least 90% of it unless each split is already down to MIN_KEYS keys (the
    same floor that applies at tp = 1 to short caches). The benchmarked model shapes -- batch 1
    at 64k and 128k on every layout and at 16k up to tp = 4, batch 8 at 32k -- get a full
    wave."""
    args = codellama_34b()
    assert (args.n_kv_heads, args.n_heads) == (8, 64)
    full_wave = {(1, c, tp) for c in (65536, 131072) for tp in (1, 2, 4, 8, 16)}
    full_wave |= {(1, 16384, tp) for tp in (1, 2, 4)} | {(8, 32768, tp) for tp in (1, 2, 4, 8, 16)}
    for batch in (1, 8):
        for context in (4096, 16384, 32768, 65536, 131072):
            for tp in (1, 2, 4, 8, 16):
                splits, grid = rank_grid(args, tp, batch, context)
                hkv = ParallelDims(tp, 1, tp).local_kv_heads(args)
                assert grid == (splits, batch * hkv, 1), (batch, context, tp, grid)
                programs = grid[0] * grid[1] * grid[2]
                where = f"batch {batch}, context {context}, tp {tp}: {splits} x {grid[1]}"
                assert programs <= SMS, where
                by_length = max(1, (context + GEN) // MIN_KEYS)
                if (batch, context, tp) in full_wave:
                    assert programs >= 0.9 * SMS, where
                else:
                    assert programs >= 0.9 * SMS or splits == by_length, where


def _model_passes_its_local_kv_heads(rank, world):
    """A tp=2 model's decode step plans its split-KV launch for its own KV head (tiny(2): one of
    two per rank), not the model's two."""
    torch.set_num_threads(1)
    mesh = ParallelDims(2, 1, world).build_mesh("cpu")
    model = _build(tiny(2), mesh)
    assert all(layer.self_attn.kv_cache.k_cache.shape[2] == 1 for layer in model.layers)
    seen = []
    choose = kd.choose_num_splits

    def recording(batch, num_kv_heads, capacity, num_sms, **kw):
        seen.append((batch, num_kv_heads))
        return choose(batch, num_kv_heads, capacity, num_sms, **kw)

    kd.choose_num_splits = recording
    try:
        with torch.no_grad(), force_triton():
            model.decode_step(torch.zeros(BATCH, dtype=torch.int64),
                              torch.zeros(BATCH, dtype=torch.int64))
    finally:
        kd.choose_num_splits = choose
    assert seen == [(BATCH, 1)] * len(model.layers), seen
    dist.barrier()


@pytest.mark.interpreter
def test_tp2_model_plans_decode_for_its_local_kv_heads():
    run_distributed(_model_passes_its_local_kv_heads, 2)
