"""Sequence parallelism: each sequence's KV cache is split by position over the sp group.

Prefill runs ring attention (longctx.parallel.ring) over the prompt sharded in the zigzag layout;
each rank copies its K/V shard into its cache. Each decode step every rank attends over its shard
and the group's partial states (O, LSE) are merged exactly with `merge_states_group`. New tokens
are placed round-robin: position p >= the ring-prefilled length lives on sp rank p % sp at local
slot p // sp, so the shards never differ by more than one token.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from longctx.merge import merge_states_group
from longctx.model import KVCache, Transformer
from longctx.parallel.ring import ring_attention, shard_chunks, shard_sequence

LAYOUT = "zigzag"  # ring prefill's layout: rank r holds chunks r and 2sp-1-r (balanced causal work)


class SequenceParallelKVCache(KVCache):
    """This rank's shard of a layer's KV cache: k_cache, v_cache [B, ceil(S_max / sp) + 1, Hkv, D].

    Slots [0, n/sp) hold this rank's zigzag shard of the first n ring-prefilled positions; later
    positions follow the round-robin rule. The last slot is scratch: a decode step writes the new
    token there on ranks that do not own its position (a fixed-shape write instead of a
    data-dependent branch, so the step stays capturable in a CUDA graph); it is never read.
    """

    def __init__(self, batch: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, *, group) -> None:
        self.group = group
        self.sp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.capacity = -(-max_seq_len // self.sp)  # slots for owned positions
        super().__init__(batch, self.capacity + 1, n_kv_heads, head_dim, dtype, device)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                input_pos: torch.Tensor) -> torch.Tensor:
        """This rank's zigzag shard of the first n prompt positions (n divisible by 2 sp):
        q [B, n/sp, Hq, D], k/v [B, n/sp, Hkv, D] -> o, the shard's causal attention over all n
        positions, by ring attention. input_pos is not read: the only caller is the prefill that
        apply_sequence_parallel installs, which cuts exactly this shard from position 0."""
        s_local = q.shape[1]
        if s_local > self.capacity:
            raise ValueError(f"prompt shard of {s_local} positions exceeds the KV cache shard "
                             f"({self.capacity})")
        self.k_cache[:, :s_local] = k
        self.v_cache[:, :s_local] = v
        return ring_attention(q, k, v, group=self.group, causal=True, layout=LAYOUT)

    def step_indices(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot [B] (the owned position's local slot, else the scratch slot) and this shard's
        cache_seqlens [B] int32 for a decode step at positions input_pos [B]."""
        owned = input_pos % self.sp == self.rank
        slot = torch.where(owned, input_pos // self.sp, self.capacity)
        # Positions q <= p with q % sp == rank: floor((p - rank) / sp) + 1, or 0 if p < rank.
        seqlens = torch.div(input_pos + self.sp - self.rank, self.sp, rounding_mode="floor")
        return slot, seqlens.to(torch.int32)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               step: tuple[torch.Tensor, torch.Tensor], return_lse: bool = False):
        """q [B, Hq, D], new k/v [B, Hkv, D], step = step_indices(input_pos) -> o [B, Hq, D]
        (and lse [B, Hq]): the attention over all positions <= input_pos of the whole sp group."""
        o, lse = super().decode(q, k, v, step, return_lse=True)
        o, lse = merge_states_group(o, lse, self.group)
        return (o, lse) if return_lse else o


def apply_sequence_parallel(model: Transformer, group) -> None:
    """Shard `model`'s KV caches by position over the ranks of `group` (call before
    setup_caches) and make `model.prefill(tokens, input_pos)` take the whole prompt: tokens
    [B, P] at positions 0..P-1, identical on every rank, returning the last position's logits
    [B, V] on every rank.

    Its longest prefix that the zigzag layout splits evenly (n = P - P % (2 sp)) goes through
    ring attention, each rank running the model on its shard; the last P - n (< 2 sp) tokens then
    run as decode steps, which place them round-robin.
    """
    if model.max_seq_len:
        raise RuntimeError("apply_sequence_parallel must come before model.setup_caches()")
    model.make_cache = functools.partial(SequenceParallelKVCache, group=group)
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    shard_prefill = model.prefill  # the model's own: runs on whatever rows it is given

    def prefill(tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        B, P = tokens.shape
        if input_pos.shape != (P,) or int(input_pos[0]) != 0:
            raise ValueError("sequence-parallel prefill takes the whole prompt at positions "
                             f"0..{P - 1}, got input_pos of shape {tuple(input_pos.shape)}")
        n = P - P % (2 * sp)
        logits = None
        if n:
            logits = shard_prefill(shard_sequence(tokens[:, :n], group, LAYOUT, dim=1),
                                   shard_sequence(input_pos[:n], group, LAYOUT, dim=0))
            if n == P:  # position P-1 ends one rank's shard; its logits go to every rank
                start, length = shard_chunks(n, sp, rank, LAYOUT)[-1]
                if start + length != n:
                    logits.zero_()
                dist.all_reduce(logits, group=group)
        for p in range(n, P):
            logits = model.decode_step(tokens[:, p], torch.full((B,), p, device=tokens.device))
        return logits

    model.prefill = prefill
