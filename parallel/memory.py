"""Will a tp x sp decode run fit? Memory per device, estimated from the config before anything is
allocated; the tp x sp layouts that would fit when it does not; and the largest context a layout
holds.

With chunked prefill the activations are bounded by the chunk (batch x chunk positions per
call), so the largest context is set by the weights and the KV cache (plus a fixed reserve).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longctx.config import ModelArgs
from longctx.fp8 import FP8, kv_bytes_per_element
from longctx.kernels.prefill import FP8_DEQUANT_KEYS
from longctx.parallel.mesh import ParallelDims

GiB = float(1 << 30)
CUDA_RESERVE = 2 << 30  # CUDA context, NCCL buffers, CUDA-graph pool, allocator slack


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device."""

    weights: int  # q/k/v biases (Qwen2) included
    kv_cache: int  # K and V of every layer (this rank's heads and positions, scratch slot
    # included; an fp8 cache's scales, and its smoothing means)
    rope: int  # the RoPE cos/sin tables, float32 [max_seq_len, head_dim] each
    activations: int  # the largest prefill call's live tensors (or a decode step's, or the
    # rebuild of the RoPE tables under dynamic NTK scaling), logits
    reserve: int  # fixed: CUDA context, NCCL, CUDA graphs, allocator slack (0 on a CPU)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.rope + self.activations + self.reserve

    def breakdown(self) -> str:
        return (f"weights {self.weights / GiB:.2f} + KV cache {self.kv_cache / GiB:.2f} + "
                f"RoPE tables {self.rope / GiB:.2f} + activations {self.activations / GiB:.2f} + "
                f"reserve {self.reserve / GiB:.2f} GiB")


def estimate_memory(args: ModelArgs, *, tp: int, sp: int, batch: int, prompt_len: int,
                    max_seq_len: int, dtype: torch.dtype, device_type: str,
                    prefill_chunk: int | None = None,
                    kv_cache_dtype: torch.dtype | None = None,
                    kv_smoothing: bool = True) -> MemoryEstimate:
    """Memory per device of a tp x sp decode run with caches for max_seq_len positions, after a
    prefill of prompt_len positions in chunks of prefill_chunk (None: the whole prompt in one
    call; prompt_len 0: no prefill, as with a synthetic cache). The KV cache is in
    kv_cache_dtype (None: dtype; fp8: 1 byte per element plus a float32 scale per token and KV
    head, longctx.fp8, and unless kv_smoothing is False the float32 means of K and V per
    sequence, KV head and channel: model.KVCache).

    Activations are those of the largest prefill call: batch x L / sp positions per rank, with L
    = min(prompt_len, prefill_chunk). Under sp, ring attention adds K/V shard buffers and a
    float32 accumulator, and a chunk after the first gathers its L queries on every rank and
    returns their partial outputs. Flash attention is assumed on CUDA; the CPU backend's
    reference attention materialises float32 scores [B, Hq, queries, keys] and repeats KV heads.
    On CUDA an fp8 cache's attention adds a float32 running output and one block of K and V
    dequantized to the model's dtype (kernels/prefill.py `_attend_fp8_blocks`).
    """
    e = torch.empty((), dtype=dtype).element_size()
    D, dim = args.head_dim, args.dim
    hq, hkv = args.n_heads // tp, ParallelDims(tp, sp, tp * sp).local_kv_heads(args)
    inter, vocab = args.intermediate_size // tp, args.vocab_size // tp
    layer = dim * D * (2 * hq + 2 * hkv) + 3 * dim * inter + 2 * dim
    if args.qkv_bias:
        layer += (hq + 2 * hkv) * D
    weights = (args.n_layers * layer + 2 * vocab * dim + dim) * e
    slots = max_seq_len if sp == 1 else -(-max_seq_len // sp) + 1  # + the scratch slot
    kv = int(2 * args.n_layers * batch * slots * hkv * D
             * kv_bytes_per_element(kv_cache_dtype or dtype, D))
    if kv_cache_dtype == FP8 and kv_smoothing:
        kv += 2 * args.n_layers * batch * hkv * D * 4  # k_mean, v_mean [B, Hkv, D] float32
    rope = 2 * max_seq_len * D * 4
    # Dynamic NTK scaling rebuilds them before a prefill beyond its original length
    # (Transformer.rope_for_prompt): float32 angles and the new cos/sin beside the tables in
    # use, 3.5 tables for a moment, before any activation is live.
    dynamic = args.rope_scaling is not None and args.rope_scaling.rope_type == "dynamic"
    rope_build = rope * 7 // 4 if dynamic else 0
    cpu = device_type != "cuda"

    # A decode step: logits (float32, gathered, sampled); on the CPU the reference attention's
    # scores and repeated K/V over the cache shard.
    act = 3 * batch * args.vocab_size * 4
    if cpu:
        act += batch * hq * slots * (3 + 2 * D) * 4
    L = min(prompt_len, prefill_chunk or prompt_len)  # positions per prefill call
    if L:
        t = batch * -(-L // sp)  # tokens per rank per call
        # Live in a block, bounding both the attention's and the MLP's peak: residual, normed
        # input, q/k/v, attention output, 3 MLP tensors, and the caller's previous residual.
        block = t * (3 * dim + 2 * (hq + 2 * hkv) * D + 3 * inter) * e
        extra = 0
        if sp > 1:
            ring = t * (4 * hkv * D * e + hq * D * (4 + e))  # K/V buffers, float32 accumulator
            # A later chunk: the gathered queries [B, L] (and their reordered copy), their
            # partial outputs, the all-to-all's send and receive buffers.
            cross = 4 * batch * L * hq * D * e + 2 * t * hq * D * e if prompt_len > L else 0
            extra = max(ring, cross)
        if not cpu and kv_cache_dtype == FP8:
            # a float32 O and LSE per call, and one block's dequantized K and V
            keys = batch * min(prompt_len, FP8_DEQUANT_KEYS) * hkv * D
            extra += t * hq * (D + 1) * 4 + keys * 2 * e
        scores = 0
        if cpu:  # [B, Hq, queries, keys] float32, three live, plus K/V repeated to Hq heads
            calls = [(L, prompt_len)] if sp == 1 else [(L // sp, L // sp), (L, prompt_len // sp)]
            scores = max(batch * hq * (3 * q * k + 2 * k * D) * 4 for q, k in calls)
        act = max(act, block + extra + scores)
    act = max(act, rope_build)
    return MemoryEstimate(weights, kv, rope, act, 0 if cpu else CUDA_RESERVE)


def largest_context(args: ModelArgs, *, tp: int, sp: int, available: int, batch: int,
                    gen_len: int, dtype: torch.dtype, device_type: str,
                    prefill_chunk: int | None = None, synthetic: bool = False,
                    kv_cache_dtype: torch.dtype | None = None, kv_smoothing: bool = True) -> int:
    """The largest context_len (prompt positions per sequence, gen_len more decoded) whose
    `estimate_memory` fits in `available` bytes per device with this layout: a prefill of
    context_len positions in chunks of prefill_chunk, or none when `synthetic`. 0 if none fits.
    """
    def fits(n: int) -> bool:
        est = estimate_memory(args, tp=tp, sp=sp, batch=batch, prompt_len=0 if synthetic else n,
                              max_seq_len=n + gen_len, dtype=dtype, device_type=device_type,
                              prefill_chunk=prefill_chunk, kv_cache_dtype=kv_cache_dtype,
                              kv_smoothing=kv_smoothing)
        return est.total <= available

    lo, hi = 0, 1  # fits(lo) or lo == 0; find hi that does not fit, then bisect
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


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


def _fitting_chunk(args: ModelArgs, tp: int, sp: int, available: int,
                   kw: dict) -> tuple[int, MemoryEstimate] | None:
    """The largest power-of-two prefill chunk (16384 down to 256, multiples of 2 sp, shorter
    than the current one) whose estimate fits, with that estimate; None if none does."""
    prompt_len, current = kw.get("prompt_len", 0), kw.get("prefill_chunk")
    longest = min(prompt_len, current or prompt_len)
    for chunk in (16384, 8192, 4096, 2048, 1024, 512, 256):
        if chunk < longest and chunk % (2 * sp) == 0:
            est = estimate_memory(args, tp=tp, sp=sp, **dict(kw, prefill_chunk=chunk))
            if est.total <= available:
                return chunk, est
    return None


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
        hint = ("No tp x sp layout up to 64 devices fits: shorten context_len or gen_len, lower "
                "batch or prefill_chunk.")
    chunk = _fitting_chunk(args, tp, sp, available, kw)
    if chunk is not None:
        hint += (f" Or prefill_chunk={chunk[0]} would fit this layout (about "
                 f"{chunk[1].total / GiB:.2f} GiB per device).")
    raise ValueError(
        f"not enough memory: this run needs about {est.total / GiB:.2f} GiB per device "
        f"({est.breakdown()}) with parallel.tp={tp} parallel.sp={sp}, but {where} has "
        f"{available / GiB:.2f} GiB available. {hint}")
