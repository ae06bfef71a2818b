"""Triton kernels of the merge layer: the N-way merge of partial (O, LSE) states
(`merge_states`: P parts -> one state, one launch) and the in-place fold of one part into an
accumulator (`merge_into`, the ring's step). Callers go through longctx.merge, which checks
the inputs; see there for the math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longctx.kernels.utils import cdiv, next_power_of_2, pdl_launch, pdl_wait


@triton.jit
def _rescale(m, m_new, lse):
    """The merge rule's weights against a new running max m_new: exp(m - m_new) for the state
    so far and exp(lse - m_new) for new parts. While everything seen is empty (m_new = -inf)
    they shift by 0, so exp() gives 0 instead of NaN. Empty states get weight 0."""
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return tl.exp(m - m_safe), tl.exp(lse - m_safe)


@triton.jit
def _state_lse(m, s):
    """LSE of a running state (max m, sum of weights s); log(0) = -inf if all was empty."""
    return tl.where(m == float("-inf"), 0.0, m) + tl.log(s)


@triton.jit
def _merge_kernel(
    O, LSE, O_OUT, LSE_OUT,
    P, D,
    stride_op, stride_or, stride_lp, stride_lr, stride_out_r,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program merges the P parts of one row (one query head of one token) for one chunk of
    # head_dim: decode merges have few rows, so head_dim chunks add the parallelism.
    pdl_wait(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    # Running state: lse = m + log(s), o = acc / s. m = -inf, s = 0 is the empty state.
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        p_mask = offs_p < P
        lse = tl.load(LSE + offs_p * stride_lp + r * stride_lr, mask=p_mask, other=float("-inf"))
        # O is loaded beside its LSE, not after it: one memory round trip instead of two (the
        # latency of a decode step's merge). Empty parts' O may be anything, NaN included:
        # it is replaced by 0 below, never multiplied by its zero weight.
        o_ptrs = O + offs_p[:, None] * stride_op + r * stride_or + offs_d[None, :]
        o = tl.load(o_ptrs, mask=p_mask[:, None] & d_mask[None, :], other=0.0)
        lse = lse.to(tl.float32)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        alpha, w = _rescale(m, m_new, lse)
        o = tl.where((w > 0)[:, None], o.to(tl.float32), 0.0)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        s = s * alpha + tl.sum(w, axis=0)
        m = m_new
    lse_out = _state_lse(m, s)
    o_out = acc / tl.where(s > 0, s, 1.0)
    tl.store(O_OUT + r * stride_out_r + offs_d, o_out.to(O_OUT.dtype.element_ty), mask=d_mask)
    if tl.program_id(1) == 0:
        tl.store(LSE_OUT + r, lse_out)


@triton.jit
def _merge_into_kernel(
    O, LSE, O_ACC, LSE_ACC,
    R, D, H,
    stride_or, stride_l0, stride_lh, stride_ar,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program folds BLOCK_R rows of one part into the accumulator, in place. Ring merges
    # have ~10^5-10^6 rows: whole tiles per program keep the per-program overhead (the PDL wait
    # and trigger included) small against the bytes moved.
    pdl_wait(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = rows < R
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    l_acc = tl.load(LSE_ACC + rows, mask=r_mask, other=float("-inf"))
    l_new = tl.load(LSE + (rows // H) * stride_l0 + (rows % H) * stride_lh, mask=r_mask,
                    other=float("-inf")).to(tl.float32)
    m = tl.maximum(l_acc, l_new)
    w_acc, w_new = _rescale(l_acc, m, l_new)  # the accumulator is a state of weight sum 1
    # Empty states (w == 0) are not read: an empty accumulator or part may hold anything.
    acc_tile = rows[:, None] * stride_ar + offs_d[None, :]
    o_acc = tl.load(O_ACC + acc_tile, mask=(r_mask & (w_acc > 0))[:, None] & d_mask[None, :],
                    other=0.0)
    o_new = tl.load(O + rows[:, None] * stride_or + offs_d[None, :],
                    mask=(r_mask & (w_new > 0))[:, None] & d_mask[None, :], other=0.0)
    s = w_acc + w_new
    o_out = (o_acc * w_acc[:, None] + o_new.to(tl.float32) * w_new[:, None]) \
        / tl.where(s > 0, s, 1.0)[:, None]
    # Every warp has read the old accumulator before any writes the new one. Without this
    # barrier a warp running late (e.g. beside another stream's kernel on the same SM) read the
    # LSE that a faster warp of its program had just stored (tests/test_merge_gpu.py).
    tl.debug_barrier()
    tl.store(O_ACC + acc_tile, o_out, mask=r_mask[:, None] & d_mask[None, :])
    tl.store(LSE_ACC + rows, _state_lse(m, s), mask=r_mask)


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
    R, D = o3.shape[1], o3.shape[2]
    # Allocated in their final shapes (contiguous: row r of [R, D] starts at r * D); on the
    # eager decode path every host-side op counts.
    o_out = torch.empty(o.shape[1:], dtype=out_dtype or o.dtype, device=o.device)
    lse_out = torch.empty(lse.shape[1:], dtype=torch.float32, device=o.device)
    if R:
        BLOCK_D = min(next_power_of_2(D), 32)
        BLOCK_P = max(1, min(next_power_of_2(P), 4096 // BLOCK_D))
        s_op, s_or, _ = o3.stride()
        s_lp, s_lr = lse2.stride()
        _merge_kernel[(R, cdiv(D, BLOCK_D))](
            o3, lse2, o_out, lse_out, P, D, s_op, s_or, s_lp, s_lr, D,
            BLOCK_P=BLOCK_P, BLOCK_D=BLOCK_D, num_warps=2, **pdl_launch(o.device),
        )
    return o_out, lse_out


def merge_into_triton(o_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor) -> None:
    """In place (o_acc [..., H, D] f32, lse_acc [..., H] f32) <- merge(acc, (o, lse)); lse may
    be a strided view (the ring passes its [B, S, H] transpose of attention's [B, H, S])."""
    inplace = o_acc.is_contiguous() and lse_acc.is_contiguous() and lse_acc.dtype == torch.float32
    acc_o = o_acc if inplace else o_acc.contiguous()
    acc_l = lse_acc if inplace else lse_acc.float().contiguous()
    D, H = o.shape[-1], o.shape[-2]
    o2 = _rows(o, 0)
    l2 = lse.reshape(-1, H)  # a view, no copy, for the ring's B = 1 transpose
    R = o2.shape[0]
    if R:
        BLOCK_D = next_power_of_2(D)
        BLOCK_R = max(1, min(32, 4096 // BLOCK_D))
        _merge_into_kernel[(cdiv(R, BLOCK_R),)](
            o2, l2, acc_o, acc_l, R, D, H, o2.stride(0), l2.stride(0), l2.stride(1), D,
            BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, num_warps=4, **pdl_launch(o.device),
        )
    if not inplace:
        o_acc.copy_(acc_o)
        lse_acc.copy_(acc_l)
