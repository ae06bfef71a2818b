"""Tensor parallelism's all-reduce fused with the residual add and RMSNorm that follow it.

Under tensor parallelism every row-parallel output (o_proj, down_proj) is a partial sum that is
all-reduced and then added to the residual stream, and the sum is normalised by the next
RMSNorm. At batch 1 the data is tiny (16 KB per rank) and the cost is all latency, so this is
one single-program kernel per call (instead of an all-reduce kernel, then a norm kernel):

  1. push this rank's partial sum into its slot of every rank's buffer in symmetric memory
     (memory every rank of the group can address, torch.distributed._symmetric_memory);
  2. raise this rank's flag in every peer's signal pad to the call's epoch (a release at
     system scope: the pushed data is visible to whoever sees the flag), and wait for every
     peer's flag in this rank's pad (acquire);
  3. sum the slots of the local buffer in fp32, in rank order (every rank computes
     bit-identical results), add the residual and normalise.

One NVLink crossing per call: the pushes and the flag are posted writes; the waits and the
reads are local. The buffer alternates between two halves by call parity and the flags carry
the call count, both kept in a device counter (a CUDA graph replays correctly whatever its
number of calls). A rank writes a half again two calls later, after the barrier of the call in
between, which a peer enters only once it has finished reading that half. Launched with PDL
like the other decode-step kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longctx.kernels.utils import pdl_launch, pdl_wait


@triton.jit
def _allreduce_add_rms_norm_kernel(
    BUFS, PADS, COUNTER, rank, PART, X, W, S, Y, rows, N, half_elems, slot_elems, eps,
    stride_p, stride_x, stride_s, stride_y,
    WORLD: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: no kernel writes it
    pdl_wait(USE_PDL)
    call = tl.load(COUNTER)
    epoch = call + 1  # int32 wrap-around is harmless: flags are compared for equality
    dt = PART.dtype.element_ty
    base = (call % 2) * half_elems + rank * slot_elems  # this rank's slot in the current half
    for r in range(rows):
        v = tl.load(PART + r * stride_p + offs, mask=mask)
        for p in tl.static_range(WORLD):
            dst = tl.load(BUFS + p).to(tl.pointer_type(dt)) + base + r * N
            tl.store(dst + offs, v, mask=mask)
    tl.debug_barrier()  # every thread's pushes come before the release below
    for p in tl.static_range(WORLD):
        if p != rank:
            pad = tl.load(PADS + p).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(pad + rank, epoch, sem="release", scope="sys")
    own_pad = tl.load(PADS + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        if p != rank:
            while tl.atomic_add(own_pad + p, 0, sem="acquire", scope="sys") != epoch:
                pass
    tl.debug_barrier()
    own = tl.load(BUFS + rank).to(tl.pointer_type(dt)) + (call % 2) * half_elems
    for r in range(rows):
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            # .cg: from L2, where the peers' writes land (L1 may hold an older call's data)
            total += tl.load(own + p * slot_elems + r * N + offs, mask=mask, other=0.0,
                             cache_modifier=".cg").to(tl.float32)
        x = tl.load(X + r * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x + total).to(S.dtype.element_ty)  # the residual stream, in the model's dtype
        tl.store(S + r * stride_s + offs, x, mask=mask)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        xn = (xf * inv).to(Y.dtype.element_ty).to(tl.float32)  # rounded as the Llama reference
        tl.store(Y + r * stride_y + offs, (w * xn).to(Y.dtype.element_ty), mask=mask)
    tl.store(COUNTER, epoch)


def allreduce_add_rms_norm(buf_ptrs: torch.Tensor, pad_ptrs: torch.Tensor, counter: torch.Tensor,
                           rank: int, half_elems: int, x: torch.Tensor, partial: torch.Tensor,
                           weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm(s)) with s = x + the group's sum of `partial`.

    buf_ptrs / pad_ptrs: int64 [world] device tensors, every rank's symmetric buffer (2 halves
    of half_elems elements of partial's dtype, each a slot per rank) and signal pad (>= world
    int32 flags, zeroed before first use); counter: int32 [1] device tensor, this rank's call
    count (the same on every rank). x, partial [..., N] (last stride 1; rows * N at most a
    slot, half_elems // world), weight [N].
    """
    N = x.shape[-1]
    x2, p2 = x.reshape(-1, N), partial.reshape(-1, N)
    rows, world = x2.shape[0], buf_ptrs.numel()
    slot = half_elems // world
    if rows * N > slot:
        raise ValueError(f"{rows} x {N} elements exceed a rank's slot of the symmetric buffer "
                         f"({slot})")
    s, y = torch.empty_like(x2), torch.empty_like(x2)
    BLOCK = triton.next_power_of_2(N)
    _allreduce_add_rms_norm_kernel[(1,)](
        buf_ptrs, pad_ptrs, counter, rank, p2, x2, weight, s, y, rows, N, half_elems, slot, eps,
        p2.stride(0), x2.stride(0), s.stride(0), y.stride(0),
        WORLD=world, BLOCK=BLOCK, num_warps=min(16, max(4, BLOCK // 512)),
        **pdl_launch(x.device))
    return s.view(x.shape), y.view(x.shape)
