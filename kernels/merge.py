"""Triton kernel of the merge layer: N-way merge of partial (O, LSE) states in one launch.

The same kernel serves `merge_states` (P parts -> one state) and `merge_into` (an accumulator
plus one part, updated in place: HAS_ACC reads the accumulator as an extra part). Callers go
through longctx.merge, which checks the inputs; see there for the math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longctx.kernels.utils import pdl_launch, pdl_wait


@triton.jit
def _merge_kernel(
    O, LSE, O_OUT, LSE_OUT,
    P, D,
    stride_op, stride_or, stride_lp, stride_lr, stride_out_r,
    HAS_ACC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program merges the P parts of one row (one query head of one token) for one chunk of
    # head_dim: decode merges have few rows, so head_dim chunks add the parallelism.
    pdl_wait(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    # Running state: lse = m + log(s), o = acc / s. m = -inf, s = 0 is the empty state.
    if HAS_ACC:
        m = tl.load(LSE_OUT + r).to(tl.float32)
        empty = m == float("-inf")
        s = tl.where(empty, 0.0, 1.0)
        acc = tl.load(O_OUT + r * stride_out_r + offs_d, mask=d_mask, other=0.0)
        acc = tl.where(empty, 0.0, acc.to(tl.float32))  # an empty accumulator may hold anything
    else:
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.full((), 0.0, tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        p_mask = offs_p < P
        lse = tl.load(LSE + offs_p * stride_lp + r * stride_lr, mask=p_mask, other=float("-inf"))
        lse = lse.to(tl.float32)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        # Shift by 0 while everything seen is empty, so exp() gives 0 instead of NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse - m_safe)
        # Empty parts (w == 0) are not read: their O may be anything.
        o_ptrs = O + offs_p[:, None] * stride_op + r * stride_or + offs_d[None, :]
        o = tl.load(o_ptrs, mask=(p_mask & (w > 0))[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * o.to(tl.float32), axis=0)
        s = s * alpha + tl.sum(w, axis=0)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    lse_out = m_safe + tl.log(s)  # log(0) = -inf: every part was empty
    o_out = acc / tl.where(s > 0, s, 1.0)
    tl.store(O_OUT + r * stride_out_r + offs_d, o_out.to(O_OUT.dtype.element_ty), mask=d_mask)
    if tl.program_id(1) == 0:
        tl.store(LSE_OUT + r, lse_out)


def _launch(o3: torch.Tensor, lse2: torch.Tensor, o_out: torch.Tensor, lse_out: torch.Tensor,
            has_acc: bool) -> None:
    """o3 [P, R, D] (last stride 1), lse2 [P, R], o_out [R, D] (last stride 1), lse_out [R]."""
    P, R, D = o3.shape
    if R == 0:
        return
    # merge_into updates lse_acc in place: one program per row, or a chunk's write of the new
    # LSE could race with another chunk's read of the old one.
    BLOCK_D = triton.next_power_of_2(D) if has_acc else min(triton.next_power_of_2(D), 32)
    BLOCK_P = max(1, min(triton.next_power_of_2(P), 4096 // BLOCK_D))
    _merge_kernel[(R, triton.cdiv(D, BLOCK_D))](
        o3, lse2, o_out, lse_out, P, D,
        o3.stride(0), o3.stride(1), lse2.stride(0), lse2.stride(1), o_out.stride(0),
        HAS_ACC=has_acc, BLOCK_P=BLOCK_P, BLOCK_D=BLOCK_D, num_warps=2, **pdl_launch(o3.device),
    )


def _rows(x: torch.Tensor, lead: int) -> torch.Tensor:
    """View x [lead..., R..., D] as [lead..., R, D] with unit last stride (copies only if needed)."""
    x = x.reshape(*x.shape[:lead], -1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def merge_states_triton(o: torch.Tensor, lse: torch.Tensor, out_dtype: torch.dtype | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """o [P, ..., H, D], lse [P, ..., H] float32 -> (o [..., H, D] in out_dtype (default
    o.dtype), lse [..., H] float32)."""
    P = o.shape[0]
    o3 = _rows(o, 1)
    lse2 = lse.reshape(P, -1)
    o_out = torch.empty(o3.shape[1:], dtype=out_dtype or o.dtype, device=o.device)
    lse_out = torch.empty(lse2.shape[1:], dtype=torch.float32, device=o.device)
    _launch(o3, lse2, o_out, lse_out, has_acc=False)
    return o_out.view(o.shape[1:]), lse_out.view(lse.shape[1:])


def merge_into_triton(o_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor) -> None:
    """In place (o_acc [..., H, D] f32, lse_acc [..., H] f32) <- merge(acc, (o, lse))."""
    inplace = o_acc.is_contiguous() and lse_acc.is_contiguous() and lse_acc.dtype == torch.float32
    acc_o = o_acc if inplace else o_acc.contiguous()
    acc_l = lse_acc if inplace else lse_acc.float().contiguous()
    _launch(_rows(o, 0).unsqueeze(0), lse.reshape(1, -1), acc_o.view(-1, o.shape[-1]),
            acc_l.view(-1), has_acc=True)
    if not inplace:
        o_acc.copy_(acc_o)
        lse_acc.copy_(acc_l)
