"""Sampling from logits split by vocabulary (tensor parallelism's LM head) without gathering them.

Under tensor parallelism rank r of the tp group holds the logits of tokens [r V/tp, (r+1) V/tp),
[B, V/tp] float32. `VocabParallelSampler` is what `apply_tensor_parallel` installs as the model's
`sampler` (see longctx.generate): it returns the token `longctx.generate.sample` would pick from
the full logits with the same seed, identical on every rank, and everything it does is
capturable in a CUDA graph (fixed shapes, no host sync).

- greedy (temperature 0): each rank reduces its shard to (max, global index of the first max);
  one all-gather of these pairs; the first rank holding the largest max wins. Ties go to the
  lowest token id, as torch.argmax over the whole vocabulary breaks them: the same token.
- temperature, top_p = 1: `sample` picks argmax_v p_v / E_v with p = softmax(logits / T) and
  E ~ Exp(1) drawn as one [B, V] tensor. Every rank draws that same [B, V] noise from the
  default generator (ranks are seeded alike) and keeps its columns. log is increasing and
  p_v = exp(l_v / T) / Z with Z common to the row, so argmax_v p_v / E_v =
  argmax_v (l_v / T - log E_v): no normaliser is needed, and the greedy reduction above finishes
  it. The same token as `sample` up to floating-point near-ties (the two expressions round
  differently, ~1e-7 relative; a token whose probability underflows to 0 in float32 can still
  win here, with probability below 1e-38).
- top_p < 1: the nucleus needs the global order of the probabilities. An exact scheme without
  the vocabulary -- a k-ary search for the probability threshold, each round every rank summing
  its probability mass above k candidate thresholds and one all-reduce of [B, k] float32 --
  takes ceil(31 / log2 k) rounds: 4 all-reduces of B x 1 KB at k = 256, each a latency-bound
  collective (6.7-13.4 µs in a CUDA graph on 2x H200, bench/allreduce.py) after its own small
  kernels, so ~30-60 µs per step. Gathering the logits is one all-gather of B x V x 4 bytes
  (128 KB at B = 1, V = 32000), as latency-bound at decode batch sizes (64 KB cross NVLink in
  well under 1 µs): one collective instead of four. So top_p < 1 gathers the logits and calls
  `sample` on them: the tokens are bit for bit today's.

Per decode step and rank at tp = 2, V = 32000 (CodeLlama-34B), batch B:

    mode                 before (LM head gathered)            now
    greedy               1 all-gather, sends 64,000 B x B     1 all-gather, sends 16 B x B
    temperature          1 all-gather, sends 64,000 B x B     1 all-gather, sends 16 B x B
    temperature + top_p  1 all-gather, sends 64,000 B x B     unchanged (the gather)

(each rank receives what the other sends; the all-gather's output is tp times that).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from longctx.generate import sample

__all__ = ["VocabParallelSampler", "gather_logits", "full_logits"]


def gather_logits(logits: torch.Tensor, group) -> torch.Tensor:
    """The full logits [..., V] from every rank's vocabulary shard [..., V/tp] (rank r holds
    tokens [r V/tp, (r+1) V/tp)), on every rank: one all-gather of the whole vocabulary. For
    top_p sampling, tests and debugging; not the greedy / temperature decode path."""
    tp = dist.get_world_size(group)
    if tp == 1:
        return logits
    flat = torch.empty(tp * logits.numel(), dtype=logits.dtype, device=logits.device)
    dist.all_gather_into_tensor(flat, logits.contiguous().view(-1), group=group)
    # [tp, ..., V/tp] -> [..., tp * V/tp]
    return flat.view(tp, *logits.shape).movedim(0, -2).reshape(*logits.shape[:-1], -1)


def _group_argmax(scores: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    """Token ids [B] int64 of torch.argmax over the group's concatenated scores, from this rank's
    [B, V/tp] starting at token `vocab_start`. One all-gather of B x 16 bytes per rank."""
    tp = dist.get_world_size(group)
    idx = scores.argmax(dim=-1)  # the first maximal value of the shard (NaN counts as maximal)
    best = scores.gather(-1, idx[:, None])[:, 0]
    # One collective for both: float64 holds every float32 score and token id exactly.
    mine = torch.stack([best.double(), (idx + vocab_start).double()], dim=-1)  # [B, 2]
    everyone = torch.empty(tp * mine.numel(), dtype=mine.dtype, device=mine.device)
    dist.all_gather_into_tensor(everyone, mine.view(-1), group=group)
    everyone = everyone.view(tp, *mine.shape)  # [tp, B, 2]
    # Ranks hold increasing token ranges, so the first rank with the largest max holds the lowest
    # id among equal maxima: torch.argmax's choice over the whole vocabulary.
    rank = everyone[..., 0].argmax(dim=0)  # [B]
    return everyone[..., 1].gather(0, rank[None])[0].long()


class VocabParallelSampler:
    """A model's `sampler` (longctx.generate) when its logits are this rank's vocabulary shard:
    rank `rank` of `group` holds tokens [vocab_start, vocab_start + V / tp) of `vocab_size`.

    sampler(logits [B, V/tp] float32, temperature, top_p) -> [B] int64 token ids, identical on
    every rank and equal to `sample(full logits, temperature, top_p)` with the same generator
    state (see the module docstring for the exactness of each mode and its traffic). The
    default generator advances exactly as `sample` advances it.
    """

    def __init__(self, group, vocab_size: int) -> None:
        tp, r = dist.get_world_size(group), dist.get_rank(group)
        if vocab_size % tp:
            raise ValueError(f"vocab_size ({vocab_size}) must be divisible by the tp group's "
                             f"size ({tp})")
        self.group, self.vocab_size = group, vocab_size
        self.shard = vocab_size // tp
        self.vocab_start = r * self.shard

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """Full logits [B, V] from this rank's shard [B, V/tp] (`gather_logits`)."""
        return gather_logits(logits, self.group)

    def __call__(self, logits: torch.Tensor, temperature: float = 0.0,
                 top_p: float = 1.0) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[-1] != self.shard:
            raise ValueError(f"logits must be this rank's vocabulary shard [B, {self.shard}], "
                             f"got {tuple(logits.shape)}")
        if temperature <= 0:
            return _group_argmax(logits, self.vocab_start, self.group)
        if top_p < 1.0:
            return sample(self.gather(logits), temperature, top_p)
        # `sample`'s noise: one [B, V] draw, the same on every rank; this rank's columns of it.
        noise = torch.empty(logits.shape[0], self.vocab_size, dtype=logits.dtype,
                            device=logits.device).exponential_(1)
        noise = noise[:, self.vocab_start:self.vocab_start + self.shard]
        return _group_argmax(logits / temperature - noise.log(), self.vocab_start, self.group)


def full_logits(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """What `model.prefill` / `model.decode_step` returned, as full-vocabulary logits [B, V]:
    gathered over the tp group when the model's sampler is a VocabParallelSampler (its LM head
    is split by vocabulary), else `logits` itself."""
    sampler = getattr(model, "sampler", None)
    return sampler.gather(logits) if isinstance(sampler, VocabParallelSampler) else logits
