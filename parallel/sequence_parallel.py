"""Sequence parallelism: each sequence's KV cache is split by position over the sp group.

Prefill runs the prompt in chunks (one chunk: the whole prompt), each sharded in the zigzag
layout within the chunk: rank r takes the chunk's pieces r and 2sp-1-r of 2sp and appends their
K/V to its cache shard. A chunk's queries attend (a) causally to the chunk's own keys by ring
attention (longctx.parallel.ring) over the chunk's shards, and (b) to every key of the earlier
chunks, which lie in the ranks' cache shards: the chunk's queries are all-gathered over the sp
group, every rank attends all of them (no mask: every earlier position precedes every chunk
position) to its own cache shard, and an all-to-all returns each partial state to the rank that
owns those queries, where the merge layer combines the sp partials with (a)'s state. The
communication per chunk is the chunk's queries and outputs, independent of the cache length.

Each decode step every rank attends over its shard and the group's partial states (O, LSE) are
merged exactly with `merge_states_group`. New tokens are placed round-robin: position p >= the
ring-prefilled length lives on sp rank p % sp at local slot p // sp, so the shards never differ
by more than one token.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from longctx.config import check_chunk
from longctx.fp8 import kv_means
from longctx.merge import merge_states, merge_states_group
from longctx.model import KVCache, Transformer, chunk_spans
from longctx.ops import dequantize_kv
from longctx.parallel.ring import ring_attention, shard_chunks, shard_sequence

LAYOUT = "zigzag"  # ring prefill's layout: rank r holds chunks r and 2sp-1-r (balanced causal work)


class SequenceParallelKVCache(KVCache):
    """This rank's shard of a layer's KV cache: k_cache, v_cache [B, ceil(S_max / sp) + 1, Hkv, D]
    (an fp8 cache's scales [B, ceil(S_max / sp) + 1, Hkv] alike).

    Slots [0, n/sp) hold this rank's zigzag shards of the prefill chunks of the first n positions,
    chunk after chunk; later positions follow the round-robin rule. The last slot is scratch: a
    decode step writes the new token there on ranks that do not own its position (a fixed-shape
    write instead of a data-dependent branch, so the step stays capturable in a CUDA graph); it
    is never read.
    """

    def __init__(self, batch: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, *, group, smooth: bool = True) -> None:
        self.group = group
        self.sp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.capacity = -(-max_seq_len // self.sp)  # slots for owned positions
        super().__init__(batch, self.capacity + 1, n_kv_heads, head_dim, dtype, device, smooth)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                input_pos: torch.Tensor) -> torch.Tensor:
        """This rank's zigzag shard of one prefill chunk [start, start + L) (L and start
        multiples of 2 sp, every earlier chunk already in the caches): q [B, L/sp, Hq, D],
        k/v [B, L/sp, Hkv, D], input_pos [L/sp] the shard's positions (the first is
        start + rank * L / (2 sp)) -> o [B, L/sp, Hq, D], the shard's causal attention over
        positions [0, start + L). The shard's K/V go to local slots [start/sp, (start + L)/sp).
        """
        s_local = q.shape[1]
        start = int(input_pos[0]) - self.rank * (s_local // 2)  # prefill runs eagerly
        if s_local % 2 or start % (2 * self.sp):
            raise ValueError(f"a sequence-parallel prefill chunk must be a zigzag shard of a chunk "
                             f"that starts at a multiple of 2 x sp ({2 * self.sp}): shard of "
                             f"{s_local} positions from {int(input_pos[0])} on rank {self.rank}")
        off = start // self.sp  # every earlier chunk left start/sp positions on each rank
        if off + s_local > self.capacity:
            raise ValueError(f"prefill up to position {start + s_local * self.sp} exceeds the KV "
                             f"cache shard ({self.capacity} positions per rank)")
        self.store(off, k, v)
        if self.k_scale is not None:
            # The ring's K/V travel in the model's dtype, as the fp8 cache holds them (dequantized):
            # the chunk then attends to the keys one process would read from its cache.
            end = off + s_local
            k = dequantize_kv(self.k_cache[:, off:end], self.k_scale[:, off:end], k.dtype,
                              self.k_mean)
            v = dequantize_kv(self.v_cache[:, off:end], self.v_scale[:, off:end], v.dtype,
                              self.v_mean)
        if off == 0:  # the first chunk: nothing cached before it
            return ring_attention(q, k, v, group=self.group, causal=True, layout=LAYOUT)
        o, lse = ring_attention(q, k, v, group=self.group, causal=True, layout=LAYOUT,
                                return_lse=True)
        o_parts, lse_parts = self._attend_cached(q, off)
        o_parts[0] = o  # part 0 is this rank's own (a); parts 1..sp the cached shards (b)
        lse_parts[0] = lse
        return merge_states(o_parts, lse_parts, check=False)[0]

    def take_means(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The smoothing means of the whole first chunk, of which k/v are this rank's zigzag
        shard (its sums all-reduced over the sp group), so that every rank smooths (and
        quantizes) as one process would."""
        self.k_mean.copy_(kv_means(k, self.group))
        self.v_mean.copy_(kv_means(v, self.group))

    def _attend_cached(self, q: torch.Tensor, off: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The states of this rank's chunk queries q [B, s, Hq, D] over every rank's cached
        slots [0, off): (o [1 + sp, B, s, Hq, D], lse [1 + sp, B, s, Hq] float32), part 1 + r from
        rank r's shard; part 0 is left for the caller. Communication: an all-gather of the
        chunk's queries and an all-to-all of the partial states."""
        sp, (B, s, hq, D) = self.sp, q.shape
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        q_all = torch.empty(sp, B, s, hq, D, dtype=q.dtype, device=q.device)
        gather(q_all.view(-1), q.contiguous().view(-1), group=self.group)
        # [sp, B, s] -> [B, sp * s] rows (a copy for B > 1): every query sees every cached key.
        q_all = q_all.transpose(0, 1).reshape(B, sp * s, hq, D)
        o, lse = self.attend(q_all, off, causal=False,
                             return_lse=True)  # [B, sp * s, Hq, D], [B, sp * s, Hq]
        del q_all
        # Rows of rank r's queries go back to rank r: send [sp, B, s, ...], receive parts 1..sp.
        o_send = o.view(B, sp, s, hq, D).transpose(0, 1).contiguous()
        lse_send = lse.view(B, sp, s, hq).transpose(0, 1).contiguous()  # [sp, B, s, Hq]
        del o, lse
        o_parts = torch.empty(1 + sp, B, s, hq, D, dtype=q.dtype, device=q.device)
        lse_parts = torch.empty(1 + sp, B, s, hq, dtype=lse_send.dtype, device=q.device)
        dist.all_to_all_single(o_parts[1:], o_send, group=self.group)
        dist.all_to_all_single(lse_parts[1:], lse_send, group=self.group)
        return o_parts, lse_parts

    def step_indices(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot [B] (the owned position's local slot, else the scratch slot) and this shard's
        cache_seqlens [B] int32 for a decode step at positions input_pos [B]."""
        owned = input_pos % self.sp == self.rank
        slot = torch.where(owned, input_pos // self.sp, self.capacity)
        # Positions q <= p with q % sp == rank: floor((p - rank) / sp) + 1, or 0 if p < rank.
        seqlens = torch.div(input_pos + self.sp - self.rank, self.sp, rounding_mode="floor")
        return slot, seqlens.to(torch.int32)

    def prefix_slots(self, context_len: int) -> int:
        """Slots holding positions [0, context_len) when they are placed round-robin from 0 (as
        `step_indices` counts them): the positions q < context_len with q % sp == rank. A
        prefill of n positions (a multiple of sp) leaves the same count, n / sp."""
        return max(0, -(-(context_len - self.rank) // self.sp))

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               step: tuple[torch.Tensor, torch.Tensor],
               rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor], return_lse: bool = False):
        """q [B, Hq, D], new k/v [B, Hkv, D], step = step_indices(input_pos) -> o [B, Hq, D]
        (and lse [B, Hq]): the attention over all positions <= input_pos of the whole sp group.
        rope as in KVCache.decode: every rank rotates q (and k, stored at its slot: the owned
        position's, or the scratch slot) before attending to its shard."""
        o, lse = super().decode(q, k, v, step, rope, return_lse=True)
        o, lse = merge_states_group(o, lse, self.group)
        return (o, lse) if return_lse else o


def apply_sequence_parallel(model: Transformer, group) -> None:
    """Shard `model`'s KV caches by position over the ranks of `group` (call before
    setup_caches) and make `model.prefill(tokens, input_pos, chunk=None)` take whole prompts:
    tokens [B, P] at positions start..start+P-1 (input_pos), identical on every rank, returning
    the last position's logits on every rank: [B, V], or with tensor parallelism as well the tp
    rank's vocabulary shard [B, V/tp]. start is 0, or a multiple of 2 sp after a prefill that
    has put positions [0, start) in the caches.

    The longest part that the zigzag layout splits evenly (n = P - P % (2 sp) positions) runs in
    chunks of `chunk` positions (a multiple of 2 sp; None: one chunk), each rank running the
    model on its zigzag shard of each chunk (SequenceParallelKVCache.prefill); the last P - n
    (< 2 sp) tokens then run as decode steps, which place them round-robin.
    """
    if model.max_seq_len:
        raise RuntimeError("apply_sequence_parallel must come before model.setup_caches()")
    model.make_cache = functools.partial(SequenceParallelKVCache, group=group)
    sp, rank = dist.get_world_size(group), dist.get_rank(group)

    def prefill(tokens: torch.Tensor, input_pos: torch.Tensor,
                chunk: int | None = None) -> torch.Tensor:
        chunk = check_chunk(chunk, sp)
        B, P = tokens.shape
        first = int(input_pos[0]) if P and input_pos.shape == (P,) else -1
        if first < 0 or first % (2 * sp):
            raise ValueError("sequence-parallel prefill takes positions start..start+P-1 with "
                             f"start a multiple of 2 x sp ({2 * sp}) and P >= 1, got input_pos "
                             f"of shape {tuple(input_pos.shape)} from {first}")
        model.rope_for_prompt(input_pos)
        n = P - P % (2 * sp)
        logits = None
        for start, end in chunk_spans(n, chunk):
            h = model.prefill_hidden(shard_sequence(tokens[:, start:end], group, LAYOUT, dim=1),
                                     shard_sequence(input_pos[start:end], group, LAYOUT, dim=0))
        if n == P:  # position P-1 ends one rank's shard of the last chunk; its row goes to all
            begin, length = shard_chunks(end - start, sp, rank, LAYOUT)[-1]
            if begin + length != end - start:
                h = torch.zeros_like(h)
            dist.all_reduce(h, group=group)
            logits = model.lm_head(h).float()
        for p in range(n, P):
            logits = model.decode_step(tokens[:, p], torch.full((B,), first + p,
                                                                device=tokens.device))
        return logits

    model.prefill = prefill
