"""Tensor parallelism's all-reduce fused with the residual add and RMSNorm that follow it.

Under tensor parallelism every row-parallel output (o_proj, down_proj) is a partial sum that is
all-reduced and then added to the residual stream, and the sum is normalised by the next
RMSNorm. At batch 1 the data is tiny (16 KB per rank) and the cost is all latency, so this is
one kernel per call (instead of an all-reduce kernel, then a norm kernel):

  1. copy this rank's partial sum into its buffer in symmetric memory (memory every rank of
     the group can address, torch.distributed._symmetric_memory);
  2. barrier with the peers through their signal pads (release/acquire at system scope, so
     each peer's buffer write is visible once its flag is seen);
  3. read every rank's buffer over NVLink (peer-to-peer loads; no multicast), sum in fp32 in
     rank order (every rank computes bit-identical results), add the residual and normalise.

The buffer and the signal-pad slots alternate between two halves by call parity, kept in a
device counter (so a CUDA graph replays it correctly whatever its number of calls): a rank can
only write a half again after the barrier of the call in between, which every peer enters only
after finishing its read of that half. Launched with PDL like the other decode-step kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longctx.kernels.utils import pdl_launch, pdl_wait


@triton.jit
def _barrier(PADS, rank, slot0, WORLD: tl.constexpr):
    """Signal every peer (slot0 + rank of its pad: 0 -> 1) and wait for every peer's signal in
    this rank's pad (slot0 + p: 1 -> 0, which also re-arms it). A flag the peer has not yet
    cleared from an earlier call is waited out rather than overwritten."""
    tl.debug_barrier()  # the whole program's buffer writes come before the release
    for p in tl.static_range(WORLD):
        if p != rank:
            pad = tl.load(PADS + p).to(tl.pointer_type(tl.int32))
            while tl.atomic_cas(pad + slot0 + rank, 0, 1, sem="release", scope="sys") != 0:
                pass
    own = tl.load(PADS + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        if p != rank:
            while tl.atomic_cas(own + slot0 + p, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()


@triton.jit
def _allreduce_add_rms_norm_kernel(
    BUFS, PADS, COUNTER, rank, PART, X, W, S, Y, rows, N, half_elems, eps,
    stride_p, stride_x, stride_s, stride_y,
    WORLD: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: no kernel writes it
    pdl_wait(USE_PDL)
    call = tl.load(COUNTER)
    parity = call % 2
    dt = PART.dtype.element_ty
    own = tl.load(BUFS + rank).to(tl.pointer_type(dt)) + parity * half_elems
    for r in range(rows):
        tl.store(own + r * N + offs, tl.load(PART + r * stride_p + offs, mask=mask), mask=mask)
    _barrier(PADS, rank, parity * WORLD, WORLD)
    for r in range(rows):
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            buf = tl.load(BUFS + p).to(tl.pointer_type(dt)) + parity * half_elems
            # .cv: fetch anew; a cached line could hold an earlier call's data
            total += tl.load(buf + r * N + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
        x = tl.load(X + r * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x + total).to(S.dtype.element_ty)  # the residual stream, in the model's dtype
        tl.store(S + r * stride_s + offs, x, mask=mask)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        xn = (xf * inv).to(Y.dtype.element_ty).to(tl.float32)  # rounded as the Llama reference
        tl.store(Y + r * stride_y + offs, (w * xn).to(Y.dtype.element_ty), mask=mask)
    tl.store(COUNTER, call + 1)


def allreduce_add_rms_norm(buf_ptrs: torch.Tensor, pad_ptrs: torch.Tensor, counter: torch.Tensor,
                           rank: int, half_elems: int, x: torch.Tensor, partial: torch.Tensor,
                           weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm(s)) with s = x + the group's sum of `partial`.

    buf_ptrs / pad_ptrs: int64 [world] device tensors, every rank's symmetric buffer (2 halves of
    half_elems elements of partial's dtype) and signal pad (>= 2 * world int32 slots, zeroed);
    counter: int32 [1] device tensor, this rank's call count (same on every rank).
    x, partial [..., N] (last stride 1; rows * N <= half_elems), weight [N].
    """
    N = x.shape[-1]
    x2, p2 = x.reshape(-1, N), partial.reshape(-1, N)
    rows = x2.shape[0]
    if rows * N > half_elems:
        raise ValueError(f"{rows} x {N} elements exceed the symmetric buffer ({half_elems})")
    s, y = torch.empty_like(x2), torch.empty_like(x2)
    BLOCK = triton.next_power_of_2(N)
    _allreduce_add_rms_norm_kernel[(1,)](
        buf_ptrs, pad_ptrs, counter, rank, p2, x2, weight, s, y, rows, N, half_elems, eps,
        p2.stride(0), x2.stride(0), s.stride(0), y.stride(0),
        WORLD=buf_ptrs.numel(), BLOCK=BLOCK, num_warps=min(16, max(4, BLOCK // 512)),
        **pdl_launch(x.device))
    return s.view(x.shape), y.view(x.shape)
