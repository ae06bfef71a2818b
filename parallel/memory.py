"""Will a tp x sp decode run fit? Memory per device, estimated from the config before anything is
allocated, and the tp x sp layouts that would fit when it does not."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longctx.config import ModelArgs
from longctx.parallel.mesh import ParallelDims

GiB = float(1 << 30)
CUDA_RESERVE = 2 << 30  # CUDA context, NCCL buffers, CUDA-graph pool, allocator slack


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device."""

    weights: int
    kv_cache: int
    activations: int  # prefill activations, logits, runtime reserve

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations

    def breakdown(self) -> str:
        return (f"weights {self.weights / GiB:.2f} + KV cache {self.kv_cache / GiB:.2f} + "
                f"activations {self.activations / GiB:.2f} GiB")


def estimate_memory(args: ModelArgs, *, tp: int, sp: int, batch: int, prompt_len: int,
                    max_seq_len: int, dtype: torch.dtype, device_type: str) -> MemoryEstimate:
    """Memory per device of a tp x sp decode run with caches for max_seq_len positions.

    Activations cover the prefill of a rank's prompt shard (P / sp positions; ring attention
    adds two K/V shard buffers and a float32 accumulator), assuming flash attention on CUDA; the
    CPU backend's reference attention materialises [B, Hq, P/sp, P/sp] float32 scores per call.
    """
    e = torch.empty((), dtype=dtype).element_size()
    D, dim = args.head_dim, args.dim
    hq, hkv = args.n_heads // tp, ParallelDims(tp, sp, tp * sp).local_kv_heads(args)
    inter, vocab = args.intermediate_size // tp, args.vocab_size // tp
    layer = dim * D * (2 * hq + 2 * hkv) + 3 * dim * inter + 2 * dim
    weights = (args.n_layers * layer + 2 * vocab * dim + dim) * e
    slots = max_seq_len if sp == 1 else -(-max_seq_len // sp) + 1  # + the scratch slot
    kv = 2 * args.n_layers * batch * slots * hkv * D * e
    local = -(-prompt_len // sp)
    tokens = batch * local
    # Live at once in a block: residual, normed input, q/k/v, attention output, 3 MLP tensors.
    act = tokens * (3 * dim + 2 * (hq + 2 * hkv) * D + 3 * inter) * e + 3 * batch * args.vocab_size * 4
    if sp > 1:
        act += tokens * (4 * hkv * D * e + hq * D * 4)
    if device_type == "cuda":
        act += CUDA_RESERVE
    else:
        act += 3 * batch * hq * local * local * 4
    return MemoryEstimate(weights, kv, act)


def fitting_layouts(args: ModelArgs, available: int, max_world: int = 64,
                    **kw) -> list[tuple[int, int, MemoryEstimate]]:
    """(tp, sp, estimate) of every valid power-of-two layout of the smallest world size (up to
    max_world) whose estimate fits in `available` bytes per device; [] if none."""
    world = 1
    while world <= max_world:
        fits = []
        tp = 1
        while tp <= world:
            dims = ParallelDims(tp, world // tp, world)
            try:
                dims.check_model(args)
            except ValueError:
                tp *= 2
                continue
            est = estimate_memory(args, tp=tp, sp=world // tp, **kw)
            if est.total <= available:
                fits.append((tp, world // tp, est))
            tp *= 2
        if fits:
            return fits
        world *= 2
    return []


def check_memory(args: ModelArgs, *, tp: int, sp: int, available: int, where: str,
                 **kw) -> MemoryEstimate:
    """The estimate, or ValueError stating needed vs available bytes and layouts that fit."""
    est = estimate_memory(args, tp=tp, sp=sp, **kw)
    if est.total <= available:
        return est
    fits = fitting_layouts(args, available, **kw)
    if fits:
        hint = "Layouts that fit: " + "; ".join(
            f"parallel.tp={t} parallel.sp={s} ({e.total / GiB:.2f} GiB per device)" for t, s, e in fits)
        hint += f" (torchrun --nproc_per_node={fits[0][0] * fits[0][1]})."
    else:
        hint = "No tp x sp layout up to 64 devices fits: shorten context_len or gen_len, or lower batch."
    raise ValueError(
        f"not enough memory: this run needs about {est.total / GiB:.2f} GiB per device "
        f"({est.breakdown()}) with parallel.tp={tp} parallel.sp={sp}, but {where} has "
        f"{available / GiB:.2f} GiB available. {hint}")
