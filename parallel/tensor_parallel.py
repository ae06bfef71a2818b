"""Tensor parallelism applied to a built Transformer (gpt-fast style): slice weights, add
collectives. Attention heads and the MLP are column-parallel in, row-parallel out; each
row-parallel output is all-reduced by the RMSNorm that takes it as its residual input (fused
into one kernel on GPUs with symmetric memory); the embedding and LM head are split by
vocabulary.

Works on a model on the meta device (the returned ShardPlan tells load_weights which slice each
rank reads) as well as on a model with real weights (slicing them).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from longctx.model import FusedLinear, Transformer
from longctx.ops import rms_norm
from longctx.weights import Shard, ShardPlan

log = logging.getLogger("longctx")


class SymmetricAllReduceNorm:
    """The row-parallel all-reduce of a decode step fused with the residual add and RMSNorm that
    follow it (longctx.kernels.allreduce): one kernel that sums the ranks' partial outputs with
    peer-to-peer loads from torch symmetric memory. At batch 1 a partial sum is 16 KB and an
    all-reduce is all latency: NCCL takes 13.4 µs in a CUDA graph on 2x H200, torch's one-shot
    symmetric-memory kernel 6.5 µs, and either is followed by a separate norm kernel.

    Holds one symmetric buffer per rank (two halves of MAX_BYTES, alternating by call, each a
    slot per rank) with its signal pad. Partial sums larger than a slot (prefill) go through
    NCCL instead.
    """

    MAX_BYTES = 1 << 20

    def __init__(self, group, device: torch.device, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group") and not (
                hasattr(symm_mem, "is_symm_mem_enabled_for_group")
                and symm_mem.is_symm_mem_enabled_for_group(name)):
            symm_mem.enable_symm_mem_for_group(name)  # needed by older torch releases
        world = dist.get_world_size(group)
        self.group, self.dtype = group, dtype
        self.half = self.MAX_BYTES // dtype.itemsize
        self.slot = self.half // world
        self.buf = symm_mem.empty(2 * self.half, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(self.buf, name)
        self.rank = handle.rank
        # One int32 flag per sender in each pad: the epoch of its latest call.
        handle.get_signal_pad(self.rank, (world,), dtype=torch.int32).zero_()
        self.buf_ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.pad_ptrs = torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every pad zeroed before any rank signals

    @staticmethod
    def available(device: torch.device) -> bool:
        if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
            return False
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError:
            return False
        return hasattr(symm_mem, "rendezvous") and hasattr(symm_mem, "empty")

    def fits(self, add: torch.Tensor) -> bool:
        return (add.dtype == self.dtype and add.numel() <= self.slot and add.stride(-1) == 1
                and add.is_cuda)

    def __call__(self, x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + sum over the group of add, its RMSNorm), as longctx.ops.rms_norm with `add`."""
        from longctx.kernels.allreduce import allreduce_add_rms_norm

        return allreduce_add_rms_norm(self.buf_ptrs, self.pad_ptrs, self.counter, self.rank,
                                      self.half, x, add, weight, eps)


class AllReduceRMSNorm(nn.Module):
    """A tensor-parallel model's RMSNorm: its residual input `add` (when given) is a row-parallel
    partial sum (o_proj's or down_proj's output: see Block.forward), so it is all-reduced over
    the group first -- fused into one kernel with symmetric memory when `fused` is given and the
    tensor fits, else NCCL (or gloo) then longctx.ops.rms_norm. Keeps the norm's `weight`, so
    checkpoint names are unchanged."""

    def __init__(self, norm: nn.Module, group, fused: SymmetricAllReduceNorm | None) -> None:
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps
        self.group, self.fused = group, fused

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None):
        if add is None:
            return rms_norm(x, self.weight, self.eps)
        if self.fused is not None and self.fused.fits(add) and x.stride(-1) == 1:
            return self.fused(x, add, self.weight, self.eps)
        dist.all_reduce(add, group=self.group)
        return rms_norm(x, self.weight, self.eps, add)


def _all_gather_last_dim_hook(group):
    def hook(_module, _inputs, out):
        tp = dist.get_world_size(group)
        flat = torch.empty(tp * out.numel(), dtype=out.dtype, device=out.device)
        dist.all_gather_into_tensor(flat, out.contiguous().view(-1), group=group)
        # [tp, ..., V/tp] -> [..., tp * V/tp]: rank r holds vocabulary rows r*V/tp ...
        return flat.view(tp, *out.shape).movedim(0, -2).reshape(*out.shape[:-1], -1)
    return hook


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [vocab_start, vocab_start + rows) of the vocabulary; ids outside that range
    give zeros, and an all-reduce over the group completes every row."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [V / tp, dim]
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside[..., None], 0)
        dist.all_reduce(x, group=self.group)
        return x


def _narrow(weight: torch.Tensor, shard: Shard) -> nn.Parameter:
    return nn.Parameter(weight.narrow(shard.dim, shard.start, shard.length).clone(),
                        requires_grad=False)


def apply_tensor_parallel(model: Transformer, group, device: torch.device | None = None,
                          dtype: torch.dtype | None = None) -> ShardPlan:
    """Shard `model` over the ranks of `group` in place; returns the Shard of each sliced
    checkpoint tensor (e.g. layers.0.self_attn.k_proj.weight, a part of the fused qkv_proj).

    Rank r keeps query heads [r*Hq/tp, (r+1)*Hq/tp) and the KV heads they read: a tp-th of the KV
    heads, or, when tp > Hkv, the one KV head of its query heads (replicated on tp/Hkv ranks).
    Call before setup_caches (the caches are sized from the attention's sliced head counts).
    On CUDA (`device`, with the weights' `dtype`) the row-parallel all-reduces of decode steps are
    fused with the residual add and RMSNorm through symmetric memory where torch provides it
    (SymmetricAllReduceNorm, sm_90+), else they go through NCCL.
    """
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    args = model.args
    D = args.head_dim
    plan: ShardPlan = {}

    def chunk(full: int, dim: int) -> Shard:
        return Shard(dim, r * full // tp, full // tp, full)

    if args.n_kv_heads >= tp:
        kv_shard = chunk(args.n_kv_heads * D, 0)
    else:
        kv_head = r // (tp // args.n_kv_heads)
        kv_shard = Shard(0, kv_head * D, D, args.n_kv_heads * D)

    def shard_linear(name: str, linear: nn.Linear, shard: Shard) -> None:
        linear.weight = _narrow(linear.weight, shard)
        linear.out_features, linear.in_features = linear.weight.shape
        plan[f"{name}.weight"] = shard

    def shard_fused(prefix: str, linear: FusedLinear, shards: dict[str, Shard]) -> None:
        # Each part (rows stacked along dim 0) keeps its own slice; the slices stay stacked.
        parts = linear.weight.split(list(linear.parts.values()), dim=0)
        kept = [p.narrow(0, shards[n].start, shards[n].length) for n, p in zip(linear.parts, parts)]
        linear.weight = nn.Parameter(torch.cat(kept), requires_grad=False)
        linear.out_features = linear.weight.shape[0]
        for n in linear.parts:
            linear.parts[n] = shards[n].length
            plan[f"{prefix}.{n}.weight"] = shards[n]

    fused = None
    if device is not None and dtype is not None and SymmetricAllReduceNorm.available(torch.device(device)):
        try:
            fused = SymmetricAllReduceNorm(group, torch.device(device), dtype)
        except Exception as e:  # e.g. no peer access between the GPUs: NCCL does it all
            log.warning(f"symmetric-memory all-reduce unavailable ({type(e).__name__}: {e}); "
                        "using NCCL")
        else:
            log.info("tensor parallel: decode all-reduces fused with the residual add and "
                     "RMSNorm (symmetric memory)")
    # Every norm's residual input is a row-parallel partial sum: the norms all-reduce it.
    model.norm = AllReduceRMSNorm(model.norm, group, fused)
    for i, layer in enumerate(model.layers):
        a, m = layer.self_attn, layer.mlp
        p = f"layers.{i}"
        shard_fused(f"{p}.self_attn", a.qkv_proj, {"q_proj": chunk(args.n_heads * D, 0),
                                                   "k_proj": kv_shard, "v_proj": kv_shard})
        a.n_heads, a.n_kv_heads = args.n_heads // tp, kv_shard.length // D
        shard_linear(f"{p}.self_attn.o_proj", a.o_proj, chunk(args.n_heads * D, 1))
        inter = chunk(args.intermediate_size, 0)
        shard_fused(f"{p}.mlp", m.gate_up_proj, {"gate_proj": inter, "up_proj": inter})
        shard_linear(f"{p}.mlp.down_proj", m.down_proj, chunk(args.intermediate_size, 1))
        layer.input_layernorm = AllReduceRMSNorm(layer.input_layernorm, group, fused)
        layer.post_attention_layernorm = AllReduceRMSNorm(layer.post_attention_layernorm, group,
                                                          fused)

    vocab = chunk(args.vocab_size, 0)
    model.embed_tokens = VocabParallelEmbedding(
        _narrow(model.embed_tokens.weight, vocab).data, vocab.start, group)
    plan["embed_tokens.weight"] = vocab
    shard_linear("lm_head", model.lm_head, vocab)
    model.lm_head.register_forward_hook(_all_gather_last_dim_hook(group))
    return plan
