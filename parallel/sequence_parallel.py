"""Sequence parallelism for decoding: each sequence's KV cache is split by position over the sp
group; every decode step each rank attends over its shard and the group's partial states (O, LSE)
are merged exactly with `merge_states_group`.

Placement is round-robin: position p lives on sp rank p % sp at local slot p // sp, so the
shards never differ by more than one token while new tokens are appended.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from longctx.attention import attention
from longctx.merge import merge_states_group
from longctx.model import KVCache, Transformer


class SequenceParallelKVCache(KVCache):
    """This rank's shard of a layer's KV cache: k_cache, v_cache [B, ceil(S_max / sp) + 1, Hkv, D].

    The last slot is scratch: a decode step writes the new token there on ranks that do not own
    its position (a fixed-shape write instead of a data-dependent branch, so the step stays
    capturable in a CUDA graph); it is never read.
    """

    def __init__(self, batch: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, *, group) -> None:
        self.group = group
        self.sp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.capacity = -(-max_seq_len // self.sp)  # slots for owned positions
        super().__init__(batch, self.capacity + 1, n_kv_heads, head_dim, dtype, device)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                input_pos: torch.Tensor) -> torch.Tensor:
        """The whole prompt: q [B, S, Hq, D], k/v [B, S, Hkv, D] at positions input_pos = 0..S-1.

        Stopgap until ring attention (longctx.parallel.ring) is merged: every sp rank computes
        attention over the whole prompt and keeps only its own positions' K/V. Correct, but the
        prefill is not split; ring prefill shards the prompt instead.
        """
        if int(input_pos[0]) != 0:
            raise ValueError("sequence-parallel prefill takes the whole prompt from position 0, "
                             f"got a chunk starting at {int(input_pos[0])}")
        if k.shape[1] > self.capacity * self.sp:
            raise ValueError(f"prompt of {k.shape[1]} tokens exceeds the KV cache capacity "
                             f"({self.capacity * self.sp})")
        mine = input_pos[input_pos % self.sp == self.rank]
        self.k_cache[:, mine // self.sp] = k[:, mine]
        self.v_cache[:, mine // self.sp] = v[:, mine]
        return attention(q, k, v, causal=True)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               input_pos: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D], new k/v [B, Hkv, D] at positions input_pos [B] -> o [B, Hq, D], the
        attention over all positions <= input_pos of the whole sp group."""
        owned = input_pos % self.sp == self.rank
        slot = torch.where(owned, input_pos // self.sp, self.capacity)
        # Positions q <= p with q % sp == rank: floor((p - rank) / sp) + 1, or 0 if p < rank.
        seqlens = torch.div(input_pos + self.sp - self.rank, self.sp, rounding_mode="floor")
        o, lse = self.decode_at(q, k, v, slot, seqlens.to(torch.int32), return_lse=True)
        return merge_states_group(o, lse, self.group)[0]


def apply_sequence_parallel(model: Transformer, group) -> None:
    """Make `model` keep a position shard of every KV cache over the ranks of `group`. Call
    before setup_caches."""
    if model.max_seq_len:
        raise RuntimeError("apply_sequence_parallel must come before model.setup_caches()")
    model.make_cache = functools.partial(SequenceParallelKVCache, group=group)
