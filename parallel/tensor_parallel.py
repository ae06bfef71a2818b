"""Tensor parallelism applied to a built Transformer (gpt-fast style): slice weights, add
collectives. Attention heads and the MLP are column-parallel in, row-parallel out with one
all-reduce each; the embedding and LM head are split by vocabulary.

Works on a model on the meta device (the returned ShardPlan tells load_weights which slice each
rank reads) as well as on a model with real weights (slicing them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from longctx.model import FusedLinear, Transformer
from longctx.weights import Shard, ShardPlan


def _all_reduce_hook(group):
    def hook(_module, _inputs, out):
        dist.all_reduce(out, group=group)  # row-parallel partial sums -> full output, in place
    return hook


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


def apply_tensor_parallel(model: Transformer, group) -> ShardPlan:
    """Shard `model` over the ranks of `group` in place; returns the Shard of each sliced
    checkpoint tensor (e.g. layers.0.self_attn.k_proj.weight, a part of the fused qkv_proj).

    Rank r keeps query heads [r*Hq/tp, (r+1)*Hq/tp) and the KV heads they read: a tp-th of the KV
    heads, or, when tp > Hkv, the one KV head of its query heads (replicated on tp/Hkv ranks).
    Call before setup_caches (the caches are sized from the attention's sliced head counts).
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
        a.o_proj.register_forward_hook(_all_reduce_hook(group))
        m.down_proj.register_forward_hook(_all_reduce_hook(group))

    vocab = chunk(args.vocab_size, 0)
    model.embed_tokens = VocabParallelEmbedding(
        _narrow(model.embed_tokens.weight, vocab).data, vocab.start, group)
    plan["embed_tokens.weight"] = vocab
    shard_linear("lm_head", model.lm_head, vocab)
    model.lm_head.register_forward_hook(_all_gather_last_dim_hook(group))
    return plan
