"""Hopper (sm_90) prefill attention forward in Gluon: warp-specialized (FA3-style), no ping-pong.

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

One program (CTA) = 128 query rows of one (batch, q head); the query tiles of one head are
adjacent in the grid (they stream the same K/V through the L2); causal runs walk them backwards
(longest first). `gl.warp_specialize` splits the CTA into three partitions (12 warps):

  * consumer 0 (the default partition) and consumer 1 (a worker), 4 warps each: query rows
    64 * WG .. 64 * WG + 63 of the tile, wgmma M = 64, setmaxnreg 240;
  * producer (a 1-warp worker, setmaxnreg 24): TMA loads of the two Q halves, then K_0 and,
    per tile t, K_{t+1} and V_t into 2-slot rings (tile t in slot t % 2).

A program visits key tiles 0 .. n_tiles - 1: Sk / 128 without a mask, m + 1 for causal query
tile m. Producer and consumers derive n_tiles from the program id with the same helper
(`_tile_coords`), so the producer loads exactly the tiles the consumers wait for.

mbarriers: q_bars[WG] (producer -> consumer WG: its Q half landed; parity 0);
k_full / v_full[slot] (producer -> consumers: slot filled, expect-tx; tile t waits parity
(t // 2) & 1); k_empty / v_empty[slot], count 2 (each consumer warpgroup arrives once after the
wgmma that read the slot has retired; the producer waits parity ((t // 2) & 1) ^ 1 before
loading tile t, so the first two loads of each ring pass at once). An mbarrier.arrive in a
4-warp partition is a partition-wide bar.sync plus one arrive, hence count 2 = two warpgroups.

Consumer order per tile (FA3's, S_0 softmaxed before the loop):
    wait K_{j+1}; issue S_{j+1} = Q K_{j+1}^T; O *= alpha_j; wait V_j; issue O += P_j V_j;
    wait(1) (S_{j+1} done); release K_{j+1}; softmax(S_{j+1}) -> P_{j+1}; wait(0); release V_j
then the last O += P_{n-1} V_{n-1}. Causal: only the last visited tile (the diagonal) is masked
(key c of it visible to row r = 64 * WG + i iff c <= r): the loop runs the unmasked tiles and the
round that softmaxes the diagonal tile is peeled after it; query tile 0 (n_tiles == 1) has the
diagonal as S_0, which is therefore masked with a runtime offset that keeps every key of the
other query tiles. With Sk == 128 the loop runs zero trips (no special compile-time path).

What ptxas does (bench/compile_prefill_hopper.py checks every dispatchable variant): no spills,
no C75xx wgmma-serialization warnings, consumers within their 240 registers. The softmax exp2s
of a warpgroup do NOT run under its own P V wgmma (ptxas retires it before them, see
bench/experiments/gluon_fa_hopper_ws/NOTES.md): the overlap is between the two consumer
warpgroups and with the producer's TMA. Ping-pong scheduling and 3 ring slots measured slower.
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

from longctx.kernels.merge import _rescale, _state_lse

__all__ = ["hopper_attention_fwd"]

_LOG2E = 1.4426950408889634
BLOCK_M = 128       # query rows per program
WG_ROWS = 64        # query rows per consumer warpgroup
BLOCK_N = 128       # keys per tile
HEAD_DIM = 128
NUM_STAGES = 2      # K / V ring slots
NUM_WARPS = 4       # the default partition (consumer 0); the workers add 4 + 1 (padded to 4)
CONSUMER_REGS = 240
PRODUCER_REGS = 24
_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


# --------------------------------------------------------------------------- #
# Gluon kernel: helpers
# --------------------------------------------------------------------------- #
@gluon.jit
def _tile_coords(SEQLEN_Q, SEQLEN_K, H_Q, GROUP, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr):
    """program -> (bh, m0, q_row, q_col, kv_row, kv_col, n_tiles). The query tiles of one
    (batch, head) are adjacent; causal: longest first. Producer and consumers both call this:
    n_tiles is the number of key tiles both sides go through."""
    pid = gl.program_id(0)
    num_m = SEQLEN_Q // BLOCK_M
    bh = pid // num_m
    m_tile = pid % num_m
    if CAUSAL:
        m_tile = num_m - 1 - m_tile
        n_tiles = m_tile + 1          # key tiles 0 .. m_tile, the last one the diagonal
    else:
        n_tiles = SEQLEN_K // BLOCK_N
    b = bh // H_Q
    h = bh % H_Q
    m0 = m_tile * BLOCK_M
    return (bh, m0, b * SEQLEN_Q + m0, h * HEAD_DIM, b * SEQLEN_K, (h // GROUP) * HEAD_DIM,
            n_tiles)


@gluon.jit
def _load_tile(desc, smem, full, empty, t, row0, col, BLOCK_N: gl.constexpr,
               NUM_STAGES: gl.constexpr):
    """Producer: wait until ring slot t % NS is free, then TMA-load key tile t into it."""
    slot = t % NUM_STAGES
    mbarrier.wait(empty.index(slot), ((t // NUM_STAGES) & 1) ^ 1)
    mbarrier.expect(full.index(slot), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row0 + t * BLOCK_N, col], full.index(slot),
                                    smem.index(slot))


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    """Online softmax (base 2) of one unmasked score tile s (fp32, raw Q K^T): P, alpha, m, l."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _softmax_step_masked(s, delta, m_i, l_i, qk_scale, ROWS: gl.constexpr,
                         BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """_softmax_step with key column c of the tile visible to row r iff c <= r + delta
    (delta >= 0: every row keeps column 0, so m stays finite and no -inf - (-inf) arises)."""
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    keep = gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + delta
    s = gl.where(keep, s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    p = gl.exp2(s - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _round(j, q, p_op, acc, alpha, m_i, l_i, qk_scale, k_smem, v_smem, k_full, k_empty, v_full,
           v_empty, s_zero, delta, NUM_STAGES: gl.constexpr, MASKED: gl.constexpr,
           ROWS: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
           o_layout: gl.constexpr, p_layout: gl.constexpr, dtype: gl.constexpr):
    """FA3-order round j + 1: S_{j+1} = Q K_{j+1}^T and O = alpha_j O + P_j V_j on the tensor
    cores, softmax of S_{j+1} (masked with `delta` if MASKED) -> P_{j+1}, alpha_{j+1}."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    t = j + 1
    ks = t % NUM_STAGES
    mbarrier.wait(k_full.index(ks), (t // NUM_STAGES) & 1)
    s_tok = warpgroup_mma(q, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    vs = j % NUM_STAGES
    mbarrier.wait(v_full.index(vs), (j // NUM_STAGES) & 1)
    acc_tok = warpgroup_mma(p_op, v_smem.index(vs), acc, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(ks), count=1)
    if MASKED:
        p, alpha, m_i, l_i = _softmax_step_masked(s, delta, m_i, l_i, qk_scale, ROWS, BLOCK_N,
                                                  s_layout)
    else:
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, p_op))
    mbarrier.arrive(v_empty.index(vs), count=1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    return acc, p_op, alpha, m_i, l_i


@gluon.jit
def _merge_into_state(o, lse, O_ACC, LSE_ACC, q_row, q_col,
                      stride_os, stride_oh, stride_ls, stride_lh,
                      ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, o_layout: gl.constexpr):
    """Fold a warpgroup's state (o [ROWS, HEAD_DIM] normalised fp32, lse [ROWS] natural log)
    into the running state O_ACC [B, Sq, Hq, D] / LSE_ACC [B, Sq, Hq] float32, in place.

    kernels/prefill.py's ACCUMULATE epilogue: merge_into's rule through the merge layer's own
    `_rescale` / `_state_lse` (kernels/merge.py; Triton functions, callable from Gluon). Each
    (row, head) belongs to exactly one warpgroup of one program.
    Rows are addressed like q's TMA rows, row q_row + r of [B * Sq] (batch stride Sq * seq
    stride), head q_col / HEAD_DIM.
    """
    rows = (q_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))).to(gl.int64)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    h64 = (q_col // HEAD_DIM).to(gl.int64)
    l_ptrs = LSE_ACC + h64 * stride_lh + rows * stride_ls
    o_ptrs = O_ACC + h64 * stride_oh + gl.expand_dims(rows * stride_os, 1) + gl.expand_dims(cols, 0)
    lse_old = gl.load(l_ptrs)
    m = gl.maximum(lse_old, lse)
    w_old, w_new = _rescale(lse_old, m, lse)
    # an empty running state (w_old == 0) is never read: its O may be anything, NaN included
    o_old = gl.load(o_ptrs, mask=gl.expand_dims(w_old > 0, 1), other=0.0)
    s = w_old + w_new
    o = ((o_old * gl.expand_dims(w_old, 1) + o * gl.expand_dims(w_new, 1))
         / gl.expand_dims(gl.where(s > 0, s, 1.0), 1))
    # Every thread of the warpgroup has read the old LSE (each row's LSE is held by several
    # threads, one of which stores it) before any overwrites it. Inside a partition this is a
    # named barrier over the partition's 128 threads.
    gl.thread_barrier()
    gl.store(o_ptrs, o)
    gl.store(l_ptrs, _state_lse(m, s))


# --------------------------------------------------------------------------- #
# Gluon kernel: partitions
# --------------------------------------------------------------------------- #
@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, SEQLEN_Q, SEQLEN_K, H_Q,
              GROUP, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """1 warp: Q halves, then K_0, (K_{t+1}, V_t) for t < n_tiles - 1, V_{n_tiles-1}: K runs
    one tile ahead of V, as round j of the consumers needs K_{j+1} before V_j."""
    q_bars, k_full, k_empty, v_full, v_empty = bars
    bh, m0, q_row, q_col, kv_row, kv_col, n_tiles = _tile_coords(
        SEQLEN_Q, SEQLEN_K, H_Q, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL)
    for wg in gl.static_range(2):
        mbarrier.expect(q_bars.index(wg), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + wg * (BLOCK_M // 2), q_col],
                                        q_bars.index(wg), q_smem.index(wg))
    _load_tile(k_desc, k_smem, k_full, k_empty, 0, kv_row, kv_col, BLOCK_N, NUM_STAGES)
    for t in range(n_tiles - 1):
        _load_tile(k_desc, k_smem, k_full, k_empty, t + 1, kv_row, kv_col, BLOCK_N, NUM_STAGES)
        _load_tile(v_desc, v_smem, v_full, v_empty, t, kv_row, kv_col, BLOCK_N, NUM_STAGES)
    _load_tile(v_desc, v_smem, v_full, v_empty, n_tiles - 1, kv_row, kv_col, BLOCK_N, NUM_STAGES)


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, bars, o_desc, O_ACC, LSE, stride_os, stride_oh, stride_ls,
              stride_lh, qk_scale, SEQLEN_Q, SEQLEN_K, H_Q, GROUP, WG: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, ACCUMULATE: gl.constexpr):
    """One warpgroup: query rows WG * 64 .. WG * 64 + 63 of the program's tile."""
    ROWS: gl.constexpr = BLOCK_M // 2
    q_bars, k_full, k_empty, v_full, v_empty = bars
    dtype: gl.constexpr = q_smem.dtype
    bh, m0, q_row, q_col, kv_row, kv_col, n_tiles = _tile_coords(
        SEQLEN_Q, SEQLEN_K, H_Q, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([ROWS], gl.float32, row_s)
    q = q_smem.index(WG)
    mbarrier.wait(q_bars.index(WG), 0)

    # ---- S_0 ----------------------------------------------------------------------------
    mbarrier.wait(k_full.index(0), 0)
    s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    if CAUSAL:
        # key tile 0 is the diagonal tile of query tile 0 only: delta = first row of this
        # warpgroup, >= 128 (nothing masked) for every other query tile
        p, alpha, m_i, l_i = _softmax_step_masked(s, m0 + WG * ROWS, m_i, l_i, qk_scale, ROWS,
                                                  BLOCK_N, s_layout)
    else:
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)

    # ---- rounds 1 .. n_tiles - 1 ----------------------------------------------------------
    if CAUSAL:
        # the unmasked tiles 1 .. n_tiles - 2, then the diagonal tile's round peeled
        for j in range(0, n_tiles - 2):
            acc, p_op, alpha, m_i, l_i = _round(
                j, q, p_op, acc, alpha, m_i, l_i, qk_scale, k_smem, v_smem, k_full, k_empty,
                v_full, v_empty, s_zero, 0, NUM_STAGES, False, ROWS, BLOCK_N, s_layout,
                o_layout, p_layout, dtype)
        if n_tiles > 1:
            acc, p_op, alpha, m_i, l_i = _round(
                n_tiles - 2, q, p_op, acc, alpha, m_i, l_i, qk_scale, k_smem, v_smem, k_full,
                k_empty, v_full, v_empty, s_zero, WG * ROWS, NUM_STAGES, True, ROWS, BLOCK_N,
                s_layout, o_layout, p_layout, dtype)
    else:
        for j in range(0, n_tiles - 1):
            acc, p_op, alpha, m_i, l_i = _round(
                j, q, p_op, acc, alpha, m_i, l_i, qk_scale, k_smem, v_smem, k_full, k_empty,
                v_full, v_empty, s_zero, 0, NUM_STAGES, False, ROWS, BLOCK_N, s_layout,
                o_layout, p_layout, dtype)

    # ---- the last P V -------------------------------------------------------------------
    j = n_tiles - 1
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    vs = j % NUM_STAGES
    mbarrier.wait(v_full.index(vs), (j // NUM_STAGES) & 1)
    acc_tok = warpgroup_mma(p_op, v_smem.index(vs), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, p_op))
    mbarrier.arrive(v_empty.index(vs), count=1)

    # ---- epilogue: O /= l, LSE = (m + log2 l) ln 2; store or merge --------------------------
    # Every row saw at least one key (the causal mask here is the plain diagonal): l > 0.
    acc = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    if ACCUMULATE:
        _merge_into_state(acc, gl.convert_layout(lse, row_o), O_ACC, LSE, q_row + WG * ROWS,
                          q_col, stride_os, stride_oh, stride_ls, stride_lh, ROWS, HEAD_DIM,
                          o_layout)
    else:
        offs = m0 + WG * ROWS + gl.arange(0, ROWS, layout=row_s)
        gl.store(LSE + bh.to(gl.int64) * SEQLEN_Q + offs, lse)
        # O through this warpgroup's Q half (its S GEMMs have all retired) and a TMA store
        q.store(acc.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [q_row + WG * ROWS, q_col], q)
        tma.store_wait(pendings=0)


@gluon.jit
def _attn_fwd_hopper_kernel(
    q_desc,                   # TMA descriptor over [B * Sq, Hq * D], [64, D] boxes
    k_desc, v_desc,           # over [B * Sk, Hkv * D], [BLOCK_N, D] boxes
    o_desc,                   # like q_desc over O; None when ACCUMULATE
    O_ACC,                    # ACCUMULATE: float32 [B, Sq, Hq, D] running output; else None
    LSE,                      # float32 [B, Hq, Sq] contiguous; ACCUMULATE: [B, Sq, Hq] (strides)
    stride_os, stride_oh,     # ACCUMULATE: O_ACC's seq / head strides (batch = Sq * seq, D: 1)
    stride_ls, stride_lh,     # ACCUMULATE: LSE's seq / head strides (batch = Sq * seq)
    qk_scale,                 # softmax_scale * log2(e)
    SEQLEN_Q, SEQLEN_K,       # multiples of 128; equal when CAUSAL
    H_Q, GROUP,               # query heads, Hq // Hkv
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, ACCUMULATE: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """grid = (B * Hq * Sq / BLOCK_M,), num_warps = 4 (the default partition = consumer 0)."""
    gl.static_assert(BLOCK_M == 128)
    gl.static_assert(BLOCK_N == 128)  # causal: the last visited key tile is the diagonal tile
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M // 2, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrive per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()
    bars = (q_bars, k_full, k_empty, v_full, v_empty)
    gl.warp_specialize([
        (_consumer, (q_smem, k_smem, v_smem, bars, o_desc, O_ACC, LSE, stride_os, stride_oh,
                     stride_ls, stride_lh, qk_scale, SEQLEN_Q, SEQLEN_K, H_Q, GROUP, 0, BLOCK_M,
                     BLOCK_N, HEAD_DIM, NUM_STAGES, CAUSAL, ACCUMULATE)),
        (_consumer, (q_smem, k_smem, v_smem, bars, o_desc, O_ACC, LSE, stride_os, stride_oh,
                     stride_ls, stride_lh, qk_scale, SEQLEN_Q, SEQLEN_K, H_Q, GROUP, 1, BLOCK_M,
                     BLOCK_N, HEAD_DIM, NUM_STAGES, CAUSAL, ACCUMULATE)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, SEQLEN_Q, SEQLEN_K,
                     H_Q, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, CAUSAL)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


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
        o_desc, o_acc, out = _rows_desc(o, WG_ROWS), None, (o, lse)
        strides = (0, 0, 0, 0)
    else:
        o_acc, lse = accumulate
        o_desc, out = None, None
        strides = (o_acc.stride(1), o_acc.stride(2), lse.stride(1), lse.stride(2))
    args = (_rows_desc(q, WG_ROWS), _rows_desc(k, BLOCK_N), _rows_desc(v, BLOCK_N), o_desc, o_acc,
            lse, *strides, float(softmax_scale) * _LOG2E, sq, sk, hq, hq // hkv)
    meta = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, NUM_STAGES=NUM_STAGES,
                CAUSAL=bool(causal), ACCUMULATE=accumulate is not None,
                CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=NUM_WARPS)
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
