"""Tensor parallelism applied to a built Transformer (gpt-fast style): slice weights, add
collectives. Attention heads and the MLP are column-parallel in, row-parallel out with one
all-reduce each; the embedding and LM head are split by vocabulary. The LM head's logits stay
split: the model's prefill and decode_step return this rank's shard [B, V/tp], and the sampler
installed on the model (longctx.parallel.sampling) picks tokens from the shards without gathering
the vocabulary (`full_logits` gathers them where a caller needs them).

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
from longctx.parallel.sampling import VocabParallelSampler
from longctx.weights import Shard, ShardPlan

log = logging.getLogger("longctx")


class SymmetricMemoryAllReduce:
    """Sum all-reduce for the small row-parallel outputs of a decode step ([B, 1, dim]: 16 KB
    at batch 1, two per layer), through torch symmetric memory: one kernel copies the input into
    this rank's registered buffer, meets the peers at a barrier and sums every rank's buffer with
    peer-to-peer loads over NVLink (no NVLink multicast). About half NCCL's latency for such
    sizes (bench/allreduce.py: 6.7 vs 13.4 µs on 2x H200, in a CUDA graph).

    Two buffers are used alternately: a rank may start the next all-reduce (writing its buffer)
    as soon as it has passed this one's barrier, while a peer may still be reading the buffer of
    this one. In a CUDA graph each call's buffer is fixed at capture, so the alternation holds
    across replays only for an even number of calls per graph: a decode step makes two per
    layer. Larger tensors (prefill) go to NCCL.
    """

    MAX_BYTES = 1 << 20

    def __init__(self, group, device: torch.device, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group, self.name = group, group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group") and not (
                hasattr(symm_mem, "is_symm_mem_enabled_for_group")
                and symm_mem.is_symm_mem_enabled_for_group(self.name)):
            symm_mem.enable_symm_mem_for_group(self.name)  # needed by older torch releases
        self.numel = self.MAX_BYTES // dtype.itemsize
        self.bufs = [symm_mem.empty(self.numel, dtype=dtype, device=device) for _ in range(2)]
        for b in self.bufs:
            symm_mem.rendezvous(b, self.name)
        self.dtype, self.calls = dtype, 0

    @staticmethod
    def available(device: torch.device) -> bool:
        return device.type == "cuda" and hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group of x (a new tensor, or x reduced in place by NCCL)."""
        if x.numel() > self.numel or x.dtype != self.dtype or not x.is_contiguous():
            dist.all_reduce(x, group=self.group)
            return x
        buf = self.bufs[self.calls % 2]
        self.calls += 1
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf[:x.numel()], x.view(-1), "sum",
                                                       self.name, out.view(-1))
        return out


def _all_reduce_hook(group, symmetric: SymmetricMemoryAllReduce | None):
    def hook(_module, _inputs, out):
        # row-parallel partial sums -> the full output
        if symmetric is not None:
            return symmetric(out)
        dist.all_reduce(out, group=group)
        return out
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
    Afterwards the model's logits are rank r's vocabulary shard [B, V/tp] (tokens
    [r V/tp, (r+1) V/tp)) and `model.sampler` a VocabParallelSampler that longctx.generate uses.
    On CUDA (`device`, with the weights' `dtype`) the row-parallel all-reduces of decode steps go
    through symmetric memory where torch provides it (SymmetricMemoryAllReduce), else NCCL.
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

    symmetric = None
    if device is not None and SymmetricMemoryAllReduce.available(torch.device(device)):
        try:
            symmetric = SymmetricMemoryAllReduce(group, torch.device(device), dtype)
        except Exception as e:  # e.g. no peer access between the GPUs: NCCL does it all
            log.warning(f"symmetric-memory all-reduce unavailable ({type(e).__name__}: {e}); "
                        "using NCCL")
        else:
            log.info("tensor parallel: decode all-reduces through symmetric memory (one-shot)")
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
        a.o_proj.register_forward_hook(_all_reduce_hook(group, symmetric))
        m.down_proj.register_forward_hook(_all_reduce_hook(group, symmetric))

    vocab = chunk(args.vocab_size, 0)
    model.embed_tokens = VocabParallelEmbedding(
        _narrow(model.embed_tokens.weight, vocab).data, vocab.start, group)
    plan["embed_tokens.weight"] = vocab
    shard_linear("lm_head", model.lm_head, vocab)
    model.sampler = VocabParallelSampler(group, args.vocab_size)
    return plan
