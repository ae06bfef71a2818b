"""Triton kernels of the merge layer: the N-way merge of partial (O, LSE) states
(`merge_states`: P parts -> one state, one launch) and the in-place fold of one part into an
accumulator (`merge_into`, the ring's step). Callers go through longctx.merge, which checks
the inputs; see there for the math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longctx.kernels.launch import Launch
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
def _merge_parts(O, LSE, P, stride_op, stride_or, stride_lp, offs_r, r_mask, offs_d, d_mask,
                 BLOCK_P: tl.constexpr):
    """All P parts of rows offs_r [R] over head_dim columns offs_d [C], merged by one program:
    part p of row r is O[p * stride_op + r * stride_or + d] (any float dtype) with
    LSE[p * stride_lp + r] (float32). Returns (o [R, C] float32 normalised, lse [R] float32).

    The parts are folded into the running state one at a time, BLOCK_P of them per loop step
    (unrolled, so their loads are in flight together): no reduction across threads, which a
    [parts, rows, columns] tile would need per step (measured ~0.5 µs per part in the decode
    kernel's fused merge, against ~0.14 µs so)."""
    # Running state: lse = m + log(s), o = acc / s. m = -inf, s = 0 is the empty state.
    m = tl.full(offs_r.shape, float("-inf"), tl.float32)
    s = tl.zeros(offs_r.shape, dtype=tl.float32)
    acc = tl.zeros([offs_r.shape[0], offs_d.shape[0]], dtype=tl.float32)
    o_offs = offs_r[:, None] * stride_or + offs_d[None, :]
    for p0 in range(0, P, BLOCK_P):
        for i in tl.static_range(BLOCK_P):
            p = p0 + i
            # where, not `r_mask & (p < P)`: Triton 3.9's interpreter types a scalar comparison
            # int32, and a mask and-ed with it is refused ("mask has unsupported dtype").
            rows = tl.where(p < P, r_mask, False)
            lse = tl.load(LSE + p * stride_lp + offs_r, mask=rows, other=float("-inf"))
            o = tl.load(O + p * stride_op + o_offs, mask=rows[:, None] & d_mask[None, :], other=0.0)
            m_new = tl.maximum(m, lse)
            alpha, w = _rescale(m, m_new, lse)
            # An empty part's O may be anything, NaN included: never multiplied by its zero weight.
            acc = acc * alpha[:, None] + w[:, None] * tl.where((w > 0)[:, None], o.to(tl.float32), 0.0)
            s = s * alpha + w
            m = m_new
    return acc / tl.where(s > 0, s, 1.0)[:, None], _state_lse(m, s)


@triton.jit
def _merge_kernel(
    O, LSE, O_OUT, LSE_OUT,
    P, D,
    stride_op, stride_or, stride_lp, stride_lr, stride_out_r,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program merges the P parts of one row (one query head of one token) for one chunk of
    # head_dim: decode merges have few rows, so head_dim chunks add the parallelism. The parts
    # of a step are a [BLOCK_P, BLOCK_D] tile reduced across its threads, not `_merge_parts`'
    # serial fold: here a program has one row, so the fold would leave the threads of BLOCK_P
    # parts idle (that fold suits the fused merge, one program over many rows).
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


def _aliases(view: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether `view` (from reshape / contiguous of x) shares x's memory and first element: then
    it is a view for every tensor of x's shape and strides (reshape's choice depends on nothing
    else), and x's data pointer with view's strides addresses it."""
    return view.data_ptr() == x.data_ptr() and (
        x.numel() == 0 or view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr())


def merge_states_launch(P: int, R: int, D: int, o_strides: tuple[int, int],
                        lse_strides: tuple[int, int], dtypes: tuple[torch.dtype, ...],
                        device: torch.device) -> Launch:
    """The merge kernel over o [P, R, D] (strides o_strides of its P and R dims, unit in D) and
    lse [P, R] (lse_strides) into contiguous o_out [R, D], lse_out [R] float32. dtypes: of o,
    lse, o_out (lse_out is float32). Dynamic arguments: the four pointers."""
    BLOCK_D = min(next_power_of_2(D), 32)
    BLOCK_P = max(1, min(next_power_of_2(P), 4096 // BLOCK_D))
    return Launch(_merge_kernel, (R, cdiv(D, BLOCK_D)), (*dtypes, torch.float32),
                  (P, D, *o_strides, *lse_strides, D),
                  dict(BLOCK_P=BLOCK_P, BLOCK_D=BLOCK_D, num_warps=2, **pdl_launch(device)))


class MergeStatesPlan:
    """`merge_states_triton` for one signature (shapes, strides, dtypes, device of o and lse; the
    output dtype): the launch and the output shapes, computed once."""

    __slots__ = ("o_view", "lse_view", "out_shape", "lse_shape", "out_dtype", "launch")

    def __init__(self, o: torch.Tensor, lse: torch.Tensor, out_dtype: torch.dtype | None = None):
        P = o.shape[0]
        o3 = _rows(o, 1)
        lse2 = lse.reshape(P, -1)
        # Inputs that reshape cannot view are copied on every call (contiguous copies).
        self.o_view, self.lse_view = _aliases(o3, o), _aliases(lse2, lse)
        R, D = o3.shape[1], o3.shape[2]
        self.out_shape, self.lse_shape = o.shape[1:], lse.shape[1:]
        self.out_dtype = out_dtype or o.dtype
        # Outputs are allocated in their final shapes (contiguous: row r of [R, D] starts at r * D).
        self.launch = None if R == 0 else merge_states_launch(
            P, R, D, o3.stride()[:2], lse2.stride(), (o.dtype, lse.dtype, self.out_dtype), o.device)

    def __call__(self, o: torch.Tensor, lse: torch.Tensor, device: int | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge; device: the current CUDA device for a fast launch, None for Triton's path."""
        o_out = torch.empty(self.out_shape, dtype=self.out_dtype, device=o.device)
        lse_out = torch.empty(self.lse_shape, dtype=torch.float32, device=o.device)
        if self.launch is not None:
            o3 = o if self.o_view else _rows(o, 1)
            lse2 = lse if self.lse_view else lse.reshape(o.shape[0], -1)
            if device is None:
                self.launch.generic(o3, lse2, o_out, lse_out)
            else:
                self.launch((o3.data_ptr(), lse2.data_ptr(), o_out.data_ptr(), lse_out.data_ptr()),
                            device)
        return o_out, lse_out


def merge_states_triton(o: torch.Tensor, lse: torch.Tensor, out_dtype: torch.dtype | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """o [P, ..., H, D], lse [P, ..., H] float32 -> (o [..., H, D] in out_dtype (default
    o.dtype), lse [..., H] float32). Triton's generic launch path; longctx.merge.merge_states
    caches the plan per input signature and launches directly."""
    return MergeStatesPlan(o, lse, out_dtype)(o, lse, None)


class MergeIntoPlan:
    """`merge_into_triton` for one signature (shapes, strides, dtypes, device of the four
    tensors): whether the accumulator is updated in place, and the launch."""

    __slots__ = ("inplace", "o_view", "lse_view", "launch")

    def __init__(self, o_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor) -> None:
        self.inplace = (o_acc.is_contiguous() and lse_acc.is_contiguous()
                        and lse_acc.dtype == torch.float32)
        D, H = o.shape[-1], o.shape[-2]
        o2 = _rows(o, 0)
        l2 = lse.reshape(-1, H)  # a view, no copy, for the ring's B = 1 transpose
        self.o_view, self.lse_view = _aliases(o2, o), _aliases(l2, lse)
        R = o2.shape[0]
        BLOCK_D = next_power_of_2(D)
        BLOCK_R = max(1, min(32, 4096 // BLOCK_D))
        self.launch = None if R == 0 else Launch(
            _merge_into_kernel, (cdiv(R, BLOCK_R),), (o.dtype, lse.dtype, o_acc.dtype, torch.float32),
            (R, D, H, o2.stride(0), l2.stride(0), l2.stride(1), D),
            dict(BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, num_warps=4, **pdl_launch(o.device)))

    def __call__(self, o_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor, device: int | None) -> None:
        """Merge in place; device: the current CUDA device for a fast launch, None for Triton's."""
        if self.launch is None:
            return
        acc_o = o_acc if self.inplace else o_acc.contiguous()
        acc_l = lse_acc if self.inplace else lse_acc.float().contiguous()
        o2 = o if self.o_view else _rows(o, 0)
        l2 = lse if self.lse_view else lse.reshape(-1, o.shape[-2])
        if device is None or not self.inplace:
            self.launch.generic(o2, l2, acc_o, acc_l)
        else:
            self.launch((o2.data_ptr(), l2.data_ptr(), acc_o.data_ptr(), acc_l.data_ptr()), device)
        if not self.inplace:
            o_acc.copy_(acc_o)
            lse_acc.copy_(acc_l)


def merge_into_triton(o_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor) -> None:
    """In place (o_acc [..., H, D] f32, lse_acc [..., H] f32) <- merge(acc, (o, lse)); lse may
    be a strided view.
    Triton's generic launch path; longctx.merge.merge_into caches the plan and launches directly."""
    MergeIntoPlan(o_acc, lse_acc, o, lse)(o_acc, lse_acc, o, lse, None)
