"""Tensor parallelism applied to a built Transformer (gpt-fast style): slice weights, add
collectives. Attention heads and the MLP are column-parallel in, row-parallel out with one
all-reduce each, fused into the residual add and RMSNorm that follow
(longctx.parallel.allreduce); the embedding and LM head are split by vocabulary. The LM head's logits stay
split: the model's prefill and decode_step return this rank's shard [B, V/tp], and the sampler
installed on the model (longctx.parallel.sampling) picks tokens from the shards without gathering
the vocabulary (`full_logits` gathers them where a caller needs them).

Works on a model on the meta device (the returned ShardPlan tells load_weights which slice each
rank reads) as well as on a model with real weights (slicing them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from longctx.model import FusedLinear, Linear, RMSNorm, Transformer
from longctx.parallel.allreduce import NcclAllReduce, make_all_reduce
from longctx.parallel.sampling import VocabParallelSampler
from longctx.weights import Shard, ShardPlan

class ParallelRMSNorm(RMSNorm):
    """An RMSNorm whose `add` is a row-parallel projection's partial output (in the model every
    norm's `add` is the output of o_proj or down_proj): the sum over the tensor-parallel group,
    the residual add and the norm in one call of `comm` (the push kernel on GPUs)."""

    def __init__(self, norm: RMSNorm, comm: NcclAllReduce) -> None:
        nn.Module.__init__(self)
        self.eps, self.weight, self.comm = norm.eps, norm.weight, comm

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None):
        if add is None:
            return super().forward(x)
        return self.comm.add_rms_norm(x, add, self.weight, self.eps)


class RowParallelLinear(Linear):
    """A row-parallel projection (input features split over the group): its output is this
    rank's partial sum, which the ParallelRMSNorm after it completes. `comm.linear` may push it
    into the all-reduce buffers from the GEMV itself."""

    def __init__(self, linear: Linear, comm: NcclAllReduce) -> None:
        nn.Module.__init__(self)
        if linear.bias is not None:  # it would be added once per rank
            raise ValueError("a row-parallel projection with a bias is not supported")
        self.weight, self.comm = linear.weight, comm
        self.register_parameter("bias", None)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [vocab_start, vocab_start + rows) of the vocabulary; ids outside that range
    give zeros, and an all-reduce over the group completes every row."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, comm: NcclAllReduce) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [V / tp, dim]
        self.vocab_start = vocab_start
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(x.masked_fill(outside[..., None], 0))


def _narrow(weight: torch.Tensor, shard: Shard) -> nn.Parameter:
    return nn.Parameter(weight.narrow(shard.dim, shard.start, shard.length).clone(),
                        requires_grad=False)


def apply_tensor_parallel(model: Transformer, group, device: torch.device | None = None,
                          dtype: torch.dtype | None = None, all_reduce: str = "auto") -> ShardPlan:
    """Shard `model` over the ranks of `group` in place; returns the Shard of each sliced
    checkpoint tensor (e.g. layers.0.self_attn.k_proj.weight, a part of the fused qkv_proj).

    Rank r keeps query heads [r*Hq/tp, (r+1)*Hq/tp) and the KV heads they read: a tp-th of the KV
    heads, or, when tp > Hkv, the one KV head of its query heads (replicated on tp/Hkv ranks).
    Call before setup_caches (the caches are sized from the attention's sliced head counts).
    Afterwards the model's logits are rank r's vocabulary shard [B, V/tp] (tokens
    [r V/tp, (r+1) V/tp)) and `model.sampler` a VocabParallelSampler that longctx.generate uses.
    The row-parallel projections (o_proj, down_proj) return partial sums; the norm after each
    sums them over the group, fused with its residual add (ParallelRMSNorm): on CUDA (`device`,
    with the weights' `dtype`) through `make_all_reduce(kind=all_reduce)`, the push kernel for
    decode-sized messages where symmetric memory maps the GPUs, else NCCL.
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
        # Each part (weight rows, and bias entries if any, stacked along dim 0) keeps its own
        # slice; the slices stay stacked.
        for kind in ("weight", "bias") if linear.bias is not None else ("weight",):
            parts = getattr(linear, kind).split(list(linear.parts.values()), dim=0)
            kept = [p.narrow(0, shards[n].start, shards[n].length)
                    for n, p in zip(linear.parts, parts)]
            setattr(linear, kind, nn.Parameter(torch.cat(kept), requires_grad=False))
            for n in linear.parts:
                plan[f"{prefix}.{n}.{kind}"] = shards[n]
        linear.out_features = linear.weight.shape[0]
        for n in linear.parts:
            linear.parts[n] = shards[n].length

    comm = NcclAllReduce(group)
    if device is not None:
        comm = make_all_reduce(group, torch.device(device), dtype, args.dim, all_reduce)
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
        a.o_proj = RowParallelLinear(a.o_proj, comm)
        m.down_proj = RowParallelLinear(m.down_proj, comm)
        layer.input_layernorm = ParallelRMSNorm(layer.input_layernorm, comm)
        layer.post_attention_layernorm = ParallelRMSNorm(layer.post_attention_layernorm, comm)
    model.norm = ParallelRMSNorm(model.norm, comm)

    vocab = chunk(args.vocab_size, 0)
    model.embed_tokens = VocabParallelEmbedding(
        _narrow(model.embed_tokens.weight, vocab).data, vocab.start, comm)
    plan["embed_tokens.weight"] = vocab
    shard_linear("lm_head", model.lm_head, vocab)
    model.sampler = VocabParallelSampler(group, args.vocab_size)
    return plan
