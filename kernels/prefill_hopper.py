"""Hopper (sm_90) prefill attention forward in Gluon, with intra-warpgroup softmax/GEMM overlap.

The fast path of `longctx.kernels.prefill.flash_attention_fwd` on sm_90 GPUs, for the calls that
`hopper_kernel_applies` accepts there; same output contract as its dense path. Import it only on
a CUDA machine (flash_attention_fwd does so lazily): Gluon has no interpreter.

Covers: bf16 / fp16, head_dim 128, dense q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] with Sq and Sk
positive multiples of 128, any GQA group (Hq % Hkv == 0), no mask or the plain causal diagonal
(Sq == Sk, q_start == k_start), optionally merging into a running (O, LSE) state (the ring's
fused merge). Every (batch, seq) row of q, k, v is one row of a 2-D TMA descriptor
[B * S, H * D]: unit head_dim stride, head stride D, batch stride S * seq stride (or B == 1),
16-byte aligned base and seq stride. The running state's rows are addressed the same way
(batch stride Sq * seq stride, or B == 1). Rows never come out empty here (every query sees at
least key 0), so the empty-row case of the contract (O = 0, LSE = -inf) does not arise.

One program = 128 query rows of one (batch, q head), 8 warps (two warpgroups of 64 rows). The
query tiles of one head run side by side (they stream the same K/V through the L2); causal runs
walk them backwards (longest first). Q is loaded once by TMA; K and V stream through 2-slot
shared-memory rings (TMA + one mbarrier per slot); P goes to the P V wgmma from registers. Per
128-key tile j (S_j = Q K_j^T already in registers):

    (1) issue S_{j+1} = Q K_{j+1}^T (async)
    (2) softmax of S_j (row max, exp2, row sum)        <- S_{j+1} and P_{j-1} V_{j-1} in flight
    (3) wait for all wgmma (P_{j-1} V_{j-1} and S_{j+1})
    (4) O *= alpha  (5) issue O += P_j V_j (async)
    (6) CTA barrier; TMA refill of the K slot of tile j+1 and the V slot of tile j-1

Tile 0 and the last tile are peeled. Whether ptxas keeps (2) between the HGMMAs of (1) is
visible only in SASS: `python bench/compile_prefill_hopper.py` checks every variant the dispatch
can launch (registers, spills, HGMMA / MUFU.EX2 interleaving). The kernel sits at ~255 registers:
small control-flow changes have cost the overlap or caused spills (history and measurements in
bench/experiments/gluon_fa_hopper/NOTES.md), so re-run that check after any edit.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

__all__ = ["hopper_attention_fwd"]

_LOG2E = 1.4426950408889634
BLOCK_M = 128     # query rows per program (two warpgroups of 64)
BLOCK_N = 128     # keys per tile: with 64, ptxas hoists the wgmma wait above the exp2s
HEAD_DIM = 128
NUM_STAGES = 2    # K/V ring slots
NUM_WARPS = 8
_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


# --------------------------------------------------------------------------- #
# Gluon kernel
# --------------------------------------------------------------------------- #
@gluon.jit
def _expect(desc, bars, tile, NUM_STAGES: gl.constexpr, pred):
    """Arm the mbarrier of ring slot tile % NUM_STAGES for one tile of `desc`."""
    mbarrier.expect(bars.index(tile % NUM_STAGES), desc.block_type.nbytes, pred=pred)


@gluon.jit
def _copy(desc, smem, bars, tile, row0, col, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, pred):
    """TMA-load key tile `tile` (BLOCK_N rows from row0) of K or V into ring slot tile % NUM_STAGES."""
    slot = tile % NUM_STAGES
    tma.async_copy_global_to_shared(desc, [row0 + tile * BLOCK_N, col], bars.index(slot),
                                    smem.index(slot), pred=pred)


@gluon.jit
def _issue_kv(desc, smem, bars, tile, row0, col, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              pred):
    _expect(desc, bars, tile, NUM_STAGES, pred)
    _copy(desc, smem, bars, tile, row0, col, BLOCK_N, NUM_STAGES, pred)


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    """Online softmax (base 2) of one unmasked score tile s (fp32, raw Q K^T): P, alpha, m, l."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _softmax_step_masked(s, keep, m_i, l_i, qk_scale):
    """_softmax_step with scores where `keep` is False at -inf. Every row keeps at least one
    score (the diagonal), so m stays finite and no -inf - (-inf) = NaN arises."""
    s = gl.where(keep, s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    p = gl.exp2(s - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _causal_keep(delta, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """[BLOCK_M, BLOCK_N] mask of one key tile: row r sees column c iff c <= r + delta, with
    delta = (first query row of the tile) - (first key of the key tile)."""
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    return gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + delta


@gluon.jit
def _to_operand(p, p_layout: gl.constexpr, dtype: gl.constexpr):
    """fp32 P (S accumulator layout) -> 16-bit wgmma A operand in registers."""
    return gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _mainloop(s_cur, m_i, l_i, qk_scale, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc,
              kv_row, kv_col, n_tiles, s_zero, m0, kv_step,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              NUM_STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
              p_layout: gl.constexpr, dtype: gl.constexpr, CAUSAL: gl.constexpr):
    """Key tiles 0 .. n_tiles-1 (n_tiles >= 2) in the order of the module docstring, S_0 given.

    CAUSAL (BLOCK_N == BLOCK_M): only the last tile (the diagonal one, keys m0 .. m0+BLOCK_M-1)
    is masked; tile 0 and the loop's tiles lie below the diagonal and run unmasked. Query tile 0
    (m0 == 0) comes with n_tiles == 2 and key tile 0 in both ring slots (kv_step == 0): its
    tile 0 is a dummy whose state the last tile drops (see _attn_fwd_hopper_kernel).
    """
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    # ---- tile 0, peeled: afterwards exactly one wgmma group (P_0 V_0) is in flight, the
    # state at the loop's back edge.
    mbarrier.wait(k_bars.index(1 % NUM_STAGES), (1 // NUM_STAGES) & 1)
    s_tok = warpgroup_mma(q_smem, k_smem.index(1 % NUM_STAGES).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
    p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale)
    p_op = _to_operand(p, p_layout, dtype)
    mbarrier.wait(v_bars.index(0), 0)
    acc = warpgroup_mma(p_op, v_smem.index(0), gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout),
                        use_acc=False, is_async=True)
    p_prev = p_op
    s_cur = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
    # K_0 and K_1 are consumed: refill their slots with K_NS and K_{NS+1}
    _expect(k_desc, k_bars, NUM_STAGES, NUM_STAGES, NUM_STAGES < n_tiles)
    _expect(k_desc, k_bars, NUM_STAGES + 1, NUM_STAGES, NUM_STAGES + 1 < n_tiles)
    gl.thread_barrier()
    _copy(k_desc, k_smem, k_bars, NUM_STAGES, kv_row, kv_col, BLOCK_N, NUM_STAGES,
          NUM_STAGES < n_tiles)
    _copy(k_desc, k_smem, k_bars, NUM_STAGES + 1, kv_row, kv_col, BLOCK_N, NUM_STAGES,
          NUM_STAGES + 1 < n_tiles)

    # ---- steady state: tiles 1 .. n_tiles-2 (P_{j-1} V_{j-1} in flight at the top) ----------
    for j in range(1, n_tiles - 1):
        # (1) async S_{j+1} = Q K_{j+1}^T
        nxt = j + 1
        nslot = nxt % NUM_STAGES
        mbarrier.wait(k_bars.index(nslot), (nxt // NUM_STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(nslot).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        # (2) softmax of S_j while S_{j+1} and P_{j-1} V_{j-1} run on the tensor cores
        p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale)
        # (3) wait for both. Leaving S_{j+1} in flight here (a wait(1), P_{j-1} V_{j-1} then
        # crosses the back edge) makes ptxas serialize every wgmma of the kernel (C7514).
        # deps: acc (P_{j-1} V_{j-1}'s accumulator); p_prev (its A operand: kept live up to
        # here, else ptxas reuses its registers for the softmax and must wait before it); s_cur
        # (keeps S_j's registers apart from S_{j+1}'s accumulator, else ptxas coalesces them
        # and moves the softmax above the S_{j+1} issue: no overlap).
        acc, p_prev, s_cur = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_prev, s_cur))
        p_op = _to_operand(p, p_layout, dtype)
        # (4) rescale O
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        # (5) async O += P_j V_j
        cslot = j % NUM_STAGES
        mbarrier.wait(v_bars.index(cslot), (j // NUM_STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(cslot), acc, is_async=True)
        p_prev = p_op
        # S_{j+1} is done (retired at (3)); P_j V_j stays in flight
        s_cur = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        # (6) K_{j+1} and V_{j-1} are no longer read by this warpgroup; the CTA barrier makes
        # that true for both warpgroups before TMA overwrites the slots.
        k_t = nxt + NUM_STAGES
        v_t = j - 1 + NUM_STAGES
        _expect(k_desc, k_bars, k_t, NUM_STAGES, k_t < n_tiles)
        _expect(v_desc, v_bars, v_t, NUM_STAGES, v_t < n_tiles)
        gl.thread_barrier()
        _copy(k_desc, k_smem, k_bars, k_t, kv_row, kv_col, BLOCK_N, NUM_STAGES, k_t < n_tiles)
        _copy(v_desc, v_smem, v_bars, v_t, kv_row, kv_col, BLOCK_N, NUM_STAGES, v_t < n_tiles)

    # ---- last tile (no S_next); causal: the diagonal tile (keys m0 .. m0 + BLOCK_M - 1) ------
    j = n_tiles - 1
    if CAUSAL:
        # query tile 0 ran key tile 0 unmasked as its tile 0 (a dummy): drop that state
        # (m = -inf makes alpha = 0, so l and O restart from this tile).
        m_i = gl.where(m0 == 0, float("-inf"), m_i)
        # delta = m0 - (first key of this tile) is always 0 here, but stays a runtime value on
        # purpose: with the literal 0 ptxas serialized every wgmma of the kernel (C7511) and
        # spilled 312 B (bench/experiments/gluon_fa_hopper/NOTES.md).
        keep = _causal_keep(m0 - j * kv_step, BLOCK_M, BLOCK_N, s_layout)
        p, alpha, m_i, l_i = _softmax_step_masked(s_cur, keep, m_i, l_i, qk_scale)
    else:
        p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale)
    acc, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_prev))
    p_op = _to_operand(p, p_layout, dtype)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    cslot = j % NUM_STAGES
    mbarrier.wait(v_bars.index(cslot), (j // NUM_STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(cslot), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    return acc, m_i, l_i


@gluon.jit
def _single_tile(s_cur, m_i, l_i, qk_scale, v_smem, v_bars, m0,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                 s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                 dtype: gl.constexpr, CAUSAL: gl.constexpr):
    """One key tile (Sk == BLOCK_N): softmax of S_0 (masked when causal: tile 0 is then the
    diagonal tile), O = P_0 V_0. Nothing is in flight on entry."""
    if CAUSAL:
        keep = _causal_keep(m0, BLOCK_M, BLOCK_N, s_layout)
        p, alpha, m_i, l_i = _softmax_step_masked(s_cur, keep, m_i, l_i, qk_scale)
    else:
        p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale)
    p_op = _to_operand(p, p_layout, dtype)
    mbarrier.wait(v_bars.index(0), 0)
    acc = warpgroup_mma(p_op, v_smem.index(0), gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout),
                        use_acc=False, is_async=True)
    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
    return acc, m_i, l_i


@gluon.jit
def _merge_into_state(o, lse, O_ACC, LSE_ACC, q_row, q_col,
                      stride_os, stride_oh, stride_ls, stride_lh,
                      BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, o_layout: gl.constexpr):
    """Fold the tile's state (o [BLOCK_M, HEAD_DIM] normalised fp32, lse [BLOCK_M] natural log)
    into the running state O_ACC [B, Sq, Hq, D] / LSE_ACC [B, Sq, Hq] float32, in place.

    kernels/prefill.py's ACCUMULATE epilogue, i.e. merge_into's rule (kernels/merge.py:
    _rescale, _state_lse), written in Gluon: each (row, head) belongs to exactly one program.
    Rows are addressed like q's TMA rows, row q_row + r of [B * Sq] (batch stride Sq * seq
    stride), head q_col / HEAD_DIM: q_row and q_col are live across the main loop anyway,
    while keeping batch, head and m0 live for this epilogue cost the loop its overlap in ptxas.
    """
    rows = (q_row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))).to(gl.int64)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    h64 = (q_col // HEAD_DIM).to(gl.int64)
    l_ptrs = LSE_ACC + h64 * stride_lh + rows * stride_ls
    o_ptrs = O_ACC + h64 * stride_oh + gl.expand_dims(rows * stride_os, 1) + gl.expand_dims(cols, 0)
    lse_old = gl.load(l_ptrs)
    m = gl.maximum(lse_old, lse)
    # while everything seen is empty (m = -inf) shift by 0: weights 0 instead of NaN
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    w_old = gl.exp(lse_old - m_safe)
    w_new = gl.exp(lse - m_safe)
    # an empty running state (w_old == 0) is never read: its O may be anything, NaN included
    o_old = gl.load(o_ptrs, mask=gl.expand_dims(w_old > 0, 1), other=0.0)
    s = w_old + w_new
    o = ((o_old * gl.expand_dims(w_old, 1) + o * gl.expand_dims(w_new, 1))
         / gl.expand_dims(gl.where(s > 0, s, 1.0), 1))
    # Every warp has read the old state before any overwrites it (see _merge_into_kernel).
    gl.thread_barrier()
    gl.store(o_ptrs, o)
    gl.store(l_ptrs, m_safe + gl.log(s))


@gluon.jit
def _epilogue(acc, m_i, l_i, q_bar, k_bars, v_bars, q_smem, o_desc, O_ACC, LSE,
              bh, SEQLEN_Q, m0, q_row, q_col, stride_os, stride_oh, stride_ls, stride_lh,
              BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
              s_layout: gl.constexpr, o_layout: gl.constexpr, dtype: gl.constexpr,
              ACCUMULATE: gl.constexpr):
    """O /= l, LSE = (m + log2 l) * ln 2; store both, or merge them into the running state."""
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    # Every row saw at least one key (the causal mask here is the plain diagonal): l > 0.
    acc = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453

    if ACCUMULATE:
        _merge_into_state(acc, gl.convert_layout(lse, row_o), O_ACC, LSE, q_row, q_col,
                          stride_os, stride_oh, stride_ls, stride_lh, BLOCK_M, HEAD_DIM, o_layout)
    else:
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=row_s)
        gl.store(LSE + bh.to(gl.int64) * SEQLEN_Q + offs_m, lse)
        # O through Q's shared tile (no wgmma reads it any more) and a TMA store.
        gl.thread_barrier()
        q_smem.store(acc.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [q_row, q_col], q_smem)
        tma.store_wait(pendings=0)


@gluon.jit
def _attn_fwd_hopper_kernel(
    q_desc, k_desc, v_desc,   # TMA descriptors over [B * S, H * D]: [BLOCK_M | BLOCK_N, D] boxes
    o_desc,                   # like q_desc over O; None when ACCUMULATE
    O_ACC,                    # ACCUMULATE: float32 [B, Sq, Hq, D] running output; else None
    LSE,                      # float32 [B, Hq, Sq] contiguous; ACCUMULATE: [B, Sq, Hq] (strides)
    stride_os, stride_oh,     # ACCUMULATE: O_ACC's seq / head strides (batch = Sq * seq, D: 1)
    stride_ls, stride_lh,     # ACCUMULATE: LSE's seq / head strides (batch = Sq * seq)
    qk_scale,                 # softmax_scale * log2(e)
    SEQLEN_Q, SEQLEN_K,       # multiples of 128; equal when CAUSAL
    H_Q, GROUP,               # query heads, Hq // Hkv
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, SINGLE: gl.constexpr,
    ACCUMULATE: gl.constexpr,
):
    """One program = BLOCK_M query rows of one (batch, q head); grid = (B * Hq * Sq / BLOCK_M,).

    SINGLE: Sk == BLOCK_N, every program sees one key tile (a compile-time specialisation: any
    runtime branch to a 1-tile path cost the main loop its overlap in ptxas).
    """
    gl.static_assert(BLOCK_M == 128)
    gl.static_assert(BLOCK_N == 128)  # causal: the last visited key tile is the diagonal tile
    dtype: gl.constexpr = q_desc.dtype

    # ---- program -> (batch * head, query tile): the query tiles of one head adjacent -------
    pid = gl.program_id(0)
    num_m = SEQLEN_Q // BLOCK_M
    bh = pid // num_m
    m_tile = pid % num_m
    if CAUSAL:
        m_tile = num_m - 1 - m_tile  # most expensive (last) query tiles first
    b = bh // H_Q
    h = bh % H_Q
    kvh = h // GROUP
    m0 = m_tile * BLOCK_M          # first query row of the tile within the sequence
    q_row = b * SEQLEN_Q + m0      # row of the [B * Sq, Hq * D] view
    kv_row = b * SEQLEN_K          # first row of this batch in the [B * Sk, Hkv * D] view
    q_col = h * HEAD_DIM
    kv_col = kvh * HEAD_DIM
    if SINGLE:
        n_tiles = 1
        kv_step = BLOCK_N
    elif CAUSAL:
        # Key tiles with visible keys, the last one the diagonal tile. Query tile 0 sees only
        # key tile 0, but a runtime branch to a 1-tile path (or masking tile 0 before the loop)
        # costs the loop its overlap in ptxas. So it runs the 2-tile path on key tile 0 twice:
        # ring position 1 loads key tile 0 again (kv_step = 0), tile 0 runs unmasked as a
        # dummy and the last (masked) tile drops its state. One extra tile per (batch, head).
        n_tiles = gl.maximum((m0 + BLOCK_M) // BLOCK_N, 2)
        kv_step = gl.where(m0 == 0, 0, BLOCK_N)
    else:
        n_tiles = SEQLEN_K // BLOCK_N
        kv_step = BLOCK_N

    # ---- layouts: NVMMA v3 (wgmma) accumulators, 8 warps along the rows ---------------------
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    # ---- shared memory and barriers -------------------------------------------------------
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
    fence_async_shared()

    # ---- prologue loads: Q, K_0..K_{NS-1}, V_0..V_{NS-1} ----------------------------------
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem)
    for t in gl.static_range(NUM_STAGES):
        if CAUSAL:
            # key tile t, except for query tile 0: key tile 0 in every slot (kv_step = 0); with
            # n_tiles == 2 no later load happens for it
            row0 = kv_row + t * (kv_step - BLOCK_N)
        else:
            row0 = kv_row
        _issue_kv(k_desc, k_smem, k_bars, t, row0, kv_col, BLOCK_N, NUM_STAGES, t < n_tiles)
        _issue_kv(v_desc, v_smem, v_bars, t, row0, kv_col, BLOCK_N, NUM_STAGES, t < n_tiles)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

    # ---- S_0 ----------------------------------------------------------------------------
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    s_cur = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))

    if SINGLE:
        acc, m_i, l_i = _single_tile(s_cur, m_i, l_i, qk_scale, v_smem, v_bars, m0,
                                     BLOCK_M, BLOCK_N, HEAD_DIM, s_layout, o_layout, p_layout,
                                     dtype, CAUSAL)
    else:
        acc, m_i, l_i = _mainloop(s_cur, m_i, l_i, qk_scale, q_smem, k_smem, v_smem, k_bars,
                                  v_bars, k_desc, v_desc, kv_row, kv_col, n_tiles, s_zero, m0,
                                  kv_step, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, s_layout,
                                  o_layout, p_layout, dtype, CAUSAL)
    _epilogue(acc, m_i, l_i, q_bar, k_bars, v_bars, q_smem, o_desc, O_ACC, LSE,
              bh, SEQLEN_Q, m0, q_row, q_col, stride_os, stride_oh, stride_ls, stride_lh,
              BLOCK_M, HEAD_DIM, NUM_STAGES, s_layout, o_layout, dtype, ACCUMULATE)


# --------------------------------------------------------------------------- #
# Python entry point
# --------------------------------------------------------------------------- #
def _rows_desc(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """TMA descriptor over x [B, S, H, D] as the 2-D [B * S, H * D] (row stride: x's seq stride)."""
    b, s, h, d = x.shape
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, d], _GL_DTYPE[x.dtype])
    return TensorDescriptor(x, [b * s, h * d], [x.stride(1), 1], [block_rows, d], layout)


def launch_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    accumulate: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[tuple[int], tuple, dict, tuple[torch.Tensor, torch.Tensor] | None]:
    """(grid, args, constexpr kwargs, (o, lse) or None) of one kernel launch; allocates o and lse
    unless accumulating. Shared with bench/compile_prefill_hopper.py, which compiles exactly the
    specialisations that launches with given tensors get."""
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if accumulate is None:
        o = torch.empty((batch, sq, hq, d), dtype=q.dtype, device=q.device)
        lse = torch.empty((batch, hq, sq), dtype=torch.float32, device=q.device)
        o_desc, o_acc, out = _rows_desc(o, BLOCK_M), None, (o, lse)
        strides = (0, 0, 0, 0)
    else:
        o_acc, lse = accumulate
        o_desc, out = None, None
        strides = (o_acc.stride(1), o_acc.stride(2), lse.stride(1), lse.stride(2))
    args = (_rows_desc(q, BLOCK_M), _rows_desc(k, BLOCK_N), _rows_desc(v, BLOCK_N), o_desc, o_acc,
            lse, *strides, float(softmax_scale) * _LOG2E, sq, sk, hq, hq // hkv)
    meta = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, NUM_STAGES=NUM_STAGES,
                CAUSAL=bool(causal), SINGLE=sk == BLOCK_N, ACCUMULATE=accumulate is not None,
                num_warps=NUM_WARPS)
    return (batch * hq * (sq // BLOCK_M),), args, meta, out


def hopper_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    q_start: int,
    k_start: int,
    accumulate: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Attention forward on Hopper returning (O, LSE), or merging them into a running state.

    q [B, Sq, Hq, 128], k/v [B, Sk, Hkv, 128], bf16 or fp16, on an sm_90 GPU
    -> o [B, Sq, Hq, 128] (q.dtype), lse [B, Hq, Sq] float32 (natural log).

    Only for the inputs that `longctx.kernels.prefill.hopper_kernel_applies` accepts (Sq and Sk
    multiples of 128, rows addressable by a 2-D TMA descriptor, see the module docstring); the
    launch does not re-check them. causal: row i sees key j iff k_start + j <= q_start + i, which
    this kernel takes only as the plain diagonal (Sq == Sk, q_start == k_start: ValueError
    otherwise); without causal the offsets are ignored.

    accumulate: (o_acc [B, Sq, Hq, D] float32, lse_acc [B, Sq, Hq] float32), a running state as
    `longctx.merge.merge_into` keeps it; the result is merged into it in place (rule and
    barrier of kernels/prefill.py's ACCUMULATE epilogue; o_acc is never read where lse_acc is
    -inf) and nothing is returned.
    """
    if causal and (q.shape[1] != k.shape[1] or q_start != k_start):
        raise ValueError(
            f"causal needs the plain diagonal mask here (Sq == Sk and q_start == k_start), got "
            f"Sq={q.shape[1]}, Sk={k.shape[1]}, q_start={q_start}, k_start={k_start}")
    grid, args, meta, out = launch_args(q, k, v, softmax_scale, causal, accumulate)
    _attn_fwd_hopper_kernel[grid](*args, **meta)
    return out
