"""Research spike: Hopper (sm_90) FlashAttention forward in Gluon (triton 3.6.0) with
FA3-style intra-warpgroup pipelining.

Non-causal or causal (row i sees key j iff j <= i), D = 128, Sq == Sk == S (multiple of 128),
GQA through Hq % Hkv == 0.
q [B, S, Hq, D], k/v [B, S, Hkv, D] (bf16 or fp16, contiguous)
-> o [B, S, Hq, D] (q's dtype), lse [B, Hq, S] float32 natural log.

One program = BLOCK_M = 128 query rows of one (batch, head), 8 warps = two warpgroups of
64 rows each (NVMMA v3 layout, warps_per_cta [8, 1]).  Grid order (M_FASTEST): the query
tiles of one head adjacent, or the heads of one query tile; causal walks the query tiles
backwards (longest first).  Q is loaded once by TMA (host TensorDescriptor over the [B*S, H*D] view);
K and V go through NUM_STAGES-deep shared-memory rings (TMA + one mbarrier per slot and
tensor).  P is fed to the P@V wgmma from registers (DotOperandLayout, k_width=2).  O is
written by a TMA store through Q's shared tile, LSE by a plain store.

Schedules (SCHED, see CONFIGS):
  0/1 "brief": steady-state iteration j, S_j in registers:
      (1) issue async S_{j+1} = Q K_{j+1}^T
      (2) softmax of S_j (row max, exp2, row sum, alpha)   <- S_{j+1} and PV_{j-1} in flight
      (3) wait(num_outstanding=WAIT3): PV_{j-1} done
      (4) O *= alpha  (5) issue async O += P_j V_j
      (6) wait(1): S_{j+1} done, PV_j stays in flight; CTA barrier; TMA refill of the K slot
          of tile j+1 and the V slot of tile j-1
      Tile 0 and the last tile are peeled.  SCHED=0 uses WAIT3=1 (exactly the brief);
      ptxas then serializes every wgmma (C7514).  SCHED=1 uses WAIT3=0 (wait also retires
      S_{j+1}); the softmax still runs under both GEMMs.
  2 "fa3": FA3's own order: issue S_{j+1}; O *= alpha_j; issue PV_j; wait(1); softmax of
      S_{j+1} under PV_j; wait(0).
Whether ptxas keeps the overlap is visible only in SASS: compile_offline.py prints it.

Causal (CAUSAL constexpr; brief order with BLOCK_N == BLOCK_M == 128 only): query tile m visits
key tiles 0..m, the last one (the diagonal tile) masked, the others unmasked.  Query tile 0
visits key tile 0 twice (2-tile path, first pass a discarded dummy) because any runtime branch
to a 1-tile path cost the main loop its overlap in ptxas (NOTES.md).  S == 128 (one KV tile
for every program) is a compile-time specialisation (SINGLE).
"""
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (
    tma,
    mbarrier,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@gluon.jit
def _expect(desc, bars, tile, NUM_STAGES: gl.constexpr, pred):
    """Arm the mbarrier of ring slot tile % NUM_STAGES for one tile of `desc`."""
    mbarrier.expect(bars.index(tile % NUM_STAGES), desc.block_type.nbytes, pred=pred)


@gluon.jit
def _copy(desc, smem, bars, tile, row0, col, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, pred):
    """TMA-load tile `tile` (BLOCK_N rows) of K or V into ring slot tile % NUM_STAGES."""
    slot = tile % NUM_STAGES
    tma.async_copy_global_to_shared(desc, [row0 + tile * BLOCK_N, col], bars.index(slot), smem.index(slot),
                                    pred=pred)


@gluon.jit
def _issue_kv(desc, smem, bars, tile, row0, col, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              pred):
    _expect(desc, bars, tile, NUM_STAGES, pred)
    _copy(desc, smem, bars, tile, row0, col, BLOCK_N, NUM_STAGES, pred)


@gluon.jit
def _refill_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_t, v_t, n_tiles, kv_row, kv_col,
               BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Load K tile k_t and V tile v_t (those < n_tiles) into their ring slots once every warp
    of the CTA is done reading the tiles they replace (the barrier between arming and copying)."""
    _expect(k_desc, k_bars, k_t, NUM_STAGES, k_t < n_tiles)
    _expect(v_desc, v_bars, v_t, NUM_STAGES, v_t < n_tiles)
    gl.thread_barrier()
    _copy(k_desc, k_smem, k_bars, k_t, kv_row, kv_col, BLOCK_N, NUM_STAGES, k_t < n_tiles)
    _copy(v_desc, v_smem, v_bars, v_t, kv_row, kv_col, BLOCK_N, NUM_STAGES, v_t < n_tiles)


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    """Online softmax of one score tile (fp32, raw Q K^T); returns P (fp32), alpha, m, l."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _softmax_step_masked(s, keep, m_i, l_i, qk_scale):
    """_softmax_step on the diagonal tile: scores where `keep` is False become -inf before the
    row max. Rows with no visible key so far keep m = -inf and subtract 0 instead, so that
    exp2(-inf - (-inf)) = NaN never happens (p and alpha become 0), as in kernels/prefill.py."""
    s = gl.where(keep, s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - gl.expand_dims(m_sub, 1))
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _causal_keep(delta, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """[BLOCK_M, BLOCK_N] mask of one KV tile: row r sees column c iff c <= r + delta, where
    delta = (first query row of the tile) - (first key of the KV tile)."""
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    return gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + delta


@gluon.jit
def _to_operand(p, p_layout: gl.constexpr, dtype: gl.constexpr):
    """fp32 P (S accumulator layout) -> 16-bit wgmma A operand in registers."""
    return gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _mainloop_brief(s_cur, m_i, l_i, qk_scale, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc,
                    kv_row, kv_col, n_tiles, s_zero, m0, kv_step,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                    NUM_STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                    p_layout: gl.constexpr, dtype: gl.constexpr, WAIT3: gl.constexpr,
                    CAUSAL: gl.constexpr):
    """The brief's order. Softmax(S_j) runs while S_{j+1} and PV_{j-1} are in flight.

    WAIT3 = number of wgmma groups left in flight by the wait before `O *= alpha`:
      1: exactly the brief (S_{j+1} stays in flight during the rescale and the PV issue).
         ptxas (CUDA 12.8/13 bundled with triton 3.6) then cannot prove which group that
         wait retires (PV_{j-1} crosses the loop back edge) and serializes EVERY wgmma of
         the kernel (warning C7514: each wgmma followed by a wait 0 in SASS).
      0: the wait also retires S_{j+1}; the softmax still overlaps both GEMMs, only the
         rescale + P pack + PV issue (~50 instrs) no longer overlap S_{j+1}'s tail.
    Needs n_tiles >= 2 (tile 0 and the last tile are peeled; _single_tile does n_tiles == 1).
    CAUSAL (BLOCK_N == BLOCK_M): only the last tile (the diagonal one, keys m0 .. m0+BLOCK_M-1)
    is masked; tile 0 and the loop's tiles lie fully below the diagonal and run unmasked.
    Query tile 0 (m0 == 0) comes with n_tiles == 2 and key tile 0 in both ring slots: its tile 0
    is a dummy whose state the last tile drops (see _fa_fwd_hopper_kernel).
    """
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    # ---- tile 0, peeled (n_tiles >= 2): afterwards exactly one wgmma group (PV_0) is in
    # flight, the same state as at the loop's back edge.
    mbarrier.wait(k_bars.index(1 % NUM_STAGES), (1 // NUM_STAGES) & 1)
    s_tok = warpgroup_mma(q_smem, k_smem.index(1 % NUM_STAGES).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
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
    _copy(k_desc, k_smem, k_bars, NUM_STAGES, kv_row, kv_col, BLOCK_N, NUM_STAGES, NUM_STAGES < n_tiles)
    _copy(k_desc, k_smem, k_bars, NUM_STAGES + 1, kv_row, kv_col, BLOCK_N, NUM_STAGES,
          NUM_STAGES + 1 < n_tiles)

    # ---- steady state: tiles 1 .. n_tiles-2 (PV_{j-1} in flight at the top) -------------
    for j in range(1, n_tiles - 1):
        # (1) async S_{j+1} = Q K_{j+1}^T
        nxt = j + 1
        nslot = nxt % NUM_STAGES
        mbarrier.wait(k_bars.index(nslot), (nxt // NUM_STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(nslot).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        # (2) softmax of S_j while S_{j+1} and PV_{j-1} run on the tensor cores
        p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale)
        # (3) PV_{j-1} done (issued before S_{j+1}; wgmma groups retire in order).
        # deps: acc (PV_{j-1}'s accumulator); p_prev (PV_{j-1}'s A operand: keeping it live
        # up to here stops ptxas from reusing its registers for the softmax, which would
        # force the wait before the softmax); s_cur (keeps S_j's registers distinct from
        # S_{j+1}'s accumulator, else ptxas coalesces them and moves the softmax above the
        # S_{j+1} issue, i.e. no overlap).
        acc, p_prev, s_cur = warpgroup_mma_wait(num_outstanding=WAIT3, deps=(acc, p_prev, s_cur))
        p_op = _to_operand(p, p_layout, dtype)
        # (4) rescale O
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        # (5) async O += P_j V_j
        cslot = j % NUM_STAGES
        mbarrier.wait(v_bars.index(cslot), (j // NUM_STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(cslot), acc, is_async=True)
        p_prev = p_op
        # (6) S_{j+1} done, PV_j still in flight
        s_cur = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        # release: K_{j+1} and V_{j-1} are no longer read by this warpgroup; the CTA barrier
        # makes that true for both warpgroups before the TMA overwrites the slots.
        k_t = nxt + NUM_STAGES
        v_t = j - 1 + NUM_STAGES
        _refill_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_t, v_t, n_tiles, kv_row,
                   kv_col, BLOCK_N, NUM_STAGES)

    # ---- last tile (no S_next); causal: the diagonal tile (keys m0 .. m0 + BLOCK_M - 1) ---
    j = n_tiles - 1
    if CAUSAL:
        # query tile 0 ran key tile 0 unmasked as its tile 0 (a dummy, see the kernel): drop
        # that state (m = -inf makes alpha = 0, so l and O restart from this tile).
        m_i = gl.where(m0 == 0, float("-inf"), m_i)
        # delta = m0 - (first key of this tile) is always 0 here, but stays a runtime value on
        # purpose: with the literal 0 (mask = col <= row, thread-index only) ptxas serializes
        # every wgmma of the kernel (C7511) and spills 312 B; cause not pinned down (NOTES.md).
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
    """n_tiles == 1 (the SINGLE specialisation, S == BLOCK_N): softmax of S_0 (masked when
    causal: tile 0 is then the diagonal tile), O = P_0 V_0. Nothing is in flight on entry."""
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
def _mainloop_fa3(s_cur, m_i, l_i, qk_scale, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc,
                  kv_row, kv_col, n_tiles, s_zero,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                  NUM_STAGES: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                  dtype: gl.constexpr):
    """FA3's own IntraWGOverlap order (flash-attention hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp):
    issue S_{j+1}; O *= alpha_j; issue PV_j; wait(1) -> S_{j+1}; softmax(S_{j+1}) overlapping
    PV_j; wait(0) -> PV_j.  Nothing is in flight across the loop back edge, so ptxas keeps
    the wgmmas asynchronous.
    """
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    # K_0 is consumed: refill its slot with K_NS
    _expect(k_desc, k_bars, NUM_STAGES, NUM_STAGES, NUM_STAGES < n_tiles)
    gl.thread_barrier()
    _copy(k_desc, k_smem, k_bars, NUM_STAGES, kv_row, kv_col, BLOCK_N, NUM_STAGES, NUM_STAGES < n_tiles)

    p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    for j in range(0, n_tiles - 1):
        nxt = j + 1
        nslot = nxt % NUM_STAGES
        mbarrier.wait(k_bars.index(nslot), (nxt // NUM_STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(nslot).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p_op = _to_operand(p, p_layout, dtype)
        cslot = j % NUM_STAGES
        mbarrier.wait(v_bars.index(cslot), (j // NUM_STAGES) & 1)
        acc_tok = warpgroup_mma(p_op, v_smem.index(cslot), acc, is_async=True)
        s_cur = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale)
        # p_op in deps: PV_j reads it until here; otherwise ptxas reuses its registers for
        # the softmax and hoists this wait above the exp2s (no overlap).
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, p_op))
        # release K_{j+1}, V_j
        k_t = nxt + NUM_STAGES
        v_t = j + NUM_STAGES
        _refill_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_t, v_t, n_tiles, kv_row,
                   kv_col, BLOCK_N, NUM_STAGES)

    j = n_tiles - 1
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    p_op = _to_operand(p, p_layout, dtype)
    cslot = j % NUM_STAGES
    mbarrier.wait(v_bars.index(cslot), (j // NUM_STAGES) & 1)
    acc_tok = warpgroup_mma(p_op, v_smem.index(cslot), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
    return acc, m_i, l_i



@gluon.jit
def _fa_fwd_hopper_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE,
    qk_scale,                 # softmax_scale * log2(e)
    S, H_Q, GROUP,            # seq len, q heads, Hq // Hkv
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr, SCHED: gl.constexpr,
    CAUSAL: gl.constexpr = False, M_FASTEST: gl.constexpr = True, SINGLE: gl.constexpr = False,
):
    gl.static_assert(BLOCK_M == 128)
    # causal: only the last visited tile is the diagonal one (masked), and the brief order
    # peels exactly that tile; FA3's order softmaxes the last tile inside its loop.
    gl.static_assert((not CAUSAL) or (BLOCK_N == BLOCK_M and SCHED != 2))
    dtype: gl.constexpr = q_desc.dtype

    # ---- program -> (batch*head, query tile) ----------------------------------------------
    # M_FASTEST: the query tiles of one head adjacent; else the heads of one query tile.
    # Causal: query tiles walked backwards (most expensive, last tiles scheduled first).
    pid = gl.program_id(0)
    num_m = S // BLOCK_M
    if M_FASTEST:
        bh = pid // num_m
        m_tile = pid % num_m
    else:
        num_bh = gl.num_programs(0) // num_m
        bh = pid % num_bh
        m_tile = pid // num_bh
    if CAUSAL:
        m_tile = num_m - 1 - m_tile
    b = bh // H_Q
    h = bh % H_Q
    kvh = h // GROUP
    m0 = m_tile * BLOCK_M                 # first query row of the tile within the sequence
    q_row = b * S + m0                    # row of the [B*S, Hq*D] view
    kv_row = b * S                        # first row of this batch in the [B*S, Hkv*D] view
    q_col = h * HEAD_DIM
    kv_col = kvh * HEAD_DIM
    if SINGLE:
        n_tiles = 1                           # S == BLOCK_N: every program sees one KV tile
        kv_step = BLOCK_N
    elif CAUSAL:
        # KV tiles with visible keys, the last one the diagonal tile. Query tile 0 sees only
        # key tile 0, but a runtime branch to a 1-tile path (or masking tile 0 before the
        # loop) costs the loop its overlap in ptxas (NOTES.md). So it runs the 2-tile path
        # on key tile 0 twice: ring position 1 loads key tile 0 again (kv_step = 0), tile 0
        # runs unmasked as a dummy and the last (masked) tile drops its state.
        n_tiles = gl.maximum((m0 + BLOCK_M) // BLOCK_N, 2)
        kv_step = gl.where(m0 == 0, 0, BLOCK_N)
    else:
        n_tiles = S // BLOCK_N
        kv_step = BLOCK_N

    # ---- layouts ------------------------------------------------------------------------
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    # ---- shared memory and barriers -----------------------------------------------------
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

    # ---- prologue loads: Q, K_0..K_{NS-1}, V_0..V_{NS-1} --------------------------------
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

    # ---- S_0 ---------------------------------------------------------------------------
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s_cur = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))

    if SCHED == 2:
        acc, m_i, l_i = _mainloop_fa3(s_cur, m_i, l_i, qk_scale, q_smem, k_smem, v_smem, k_bars, v_bars,
                                      k_desc, v_desc, kv_row, kv_col, n_tiles, s_zero,
                                      BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, o_layout, p_layout, dtype)
    elif SINGLE:
        acc, m_i, l_i = _single_tile(s_cur, m_i, l_i, qk_scale, v_smem, v_bars, m0,
                                     BLOCK_M, BLOCK_N, HEAD_DIM, s_layout, o_layout, p_layout, dtype,
                                     CAUSAL)
    else:
        acc, m_i, l_i = _mainloop_brief(s_cur, m_i, l_i, qk_scale, q_smem, k_smem, v_smem, k_bars,
                                        v_bars, k_desc, v_desc, kv_row, kv_col, n_tiles, s_zero, m0,
                                        kv_step, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, s_layout, o_layout,
                                        p_layout, dtype, 1 - SCHED, CAUSAL)
    _epilogue(acc, m_i, l_i, q_bar, k_bars, v_bars, q_smem, o_desc, LSE, bh, S, m0, q_row, q_col,
              BLOCK_M, NUM_STAGES, s_layout, o_layout, dtype, CAUSAL)


@gluon.jit
def _epilogue(acc, m_i, l_i, q_bar, k_bars, v_bars, q_smem, o_desc, LSE, bh, S, m0, q_row, q_col,
              BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, s_layout: gl.constexpr,
              o_layout: gl.constexpr, dtype: gl.constexpr, CAUSAL: gl.constexpr):
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    # ---- O /= l, LSE = (m + log2 l) * ln2 ----------------------------------------------
    if CAUSAL:
        # rows that saw no key (none when Sq == Sk): O = 0, LSE = -inf, as kernels/prefill.py
        empty = l_i == 0.0
        l_i = gl.where(empty, 1.0, l_i)
        l_o = gl.convert_layout(l_i, row_o)
        acc = acc / gl.expand_dims(l_o, 1)
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_i)) * 0.6931471805599453)
    else:
        l_o = gl.convert_layout(l_i, row_o)
        acc = acc / gl.expand_dims(l_o, 1)
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=row_s)
    gl.store(LSE + bh.to(gl.int64) * S + offs_m, lse)

    # O through Q's shared tile (no wgmma reads it any more) and a TMA store.
    gl.thread_barrier()
    q_smem.store(acc.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, q_col], q_smem)
    tma.store_wait(pendings=0)


_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}

# SCHED: 0 = the brief's order with wait(1) before the rescale (ptxas serializes all wgmmas),
#        1 = the brief's order with wait(0) there, 2 = FA3's IntraWGOverlap order.
CONFIGS = {
    # name: (BLOCK_N, NUM_STAGES, SCHED)
    "brief_w0_n64_s3": (64, 3, 1),
    "brief_w0_n64_s2": (64, 2, 1),
    "brief_w0_n128_s2": (128, 2, 1),
    "brief_w1_n64_s3": (64, 3, 0),
    "fa3_n64_s3": (64, 3, 2),
    "fa3_n128_s2": (128, 2, 2),
}
DEFAULT_CONFIG = "brief_w0_n128_s2"
# Same rule as kernels/prefill.py: causal runs put the heads of one query tile side by side
# unless one KV head's K+V reach 16 MiB; non-causal runs the query tiles of one head.
_L2_KV_HEAD_BYTES = 16 << 20
LAST_KERNEL = None  # the CompiledKernel of the last gluon_attention launch (check.py reports it)


def supports_causal(config):
    BLOCK_N, _, SCHED = CONFIGS[config]
    return BLOCK_N == 128 and SCHED != 2


def default_m_fastest(causal, S, D, dtype):
    return (not causal) or 2 * S * D * dtype.itemsize >= _L2_KV_HEAD_BYTES


def make_descs(q, k, v, o, BLOCK_M, BLOCK_N):
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    gdt = _GL_DTYPE[q.dtype]
    q2 = q.view(B * S, Hq * D)
    o2 = o.view(B * S, Hq * D)
    k2 = k.view(B * S, Hkv * D)
    v2 = v.view(B * S, Hkv * D)
    q_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gdt)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [BLOCK_M, D], q_layout)
    o_desc = TensorDescriptor(o2, list(o2.shape), list(o2.stride()), [BLOCK_M, D], q_layout)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [BLOCK_N, D], kv_layout)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [BLOCK_N, D], kv_layout)
    return q_desc, k_desc, v_desc, o_desc


def gluon_attention(q, k, v, softmax_scale=None, config=DEFAULT_CONFIG, causal=False, m_fastest=None):
    """o, lse = attention(q, k, v). q [B,S,Hq,128], k/v [B,S,Hkv,128], S a multiple of 128.

    causal: row i sees key j iff j <= i (Sq == Sk), brief_w0_n128_s2 only (supports_causal).
    m_fastest: grid order, True = the query tiles of one head adjacent, False = the heads of one
    query tile adjacent; None = default_m_fastest (the library's rule)."""
    if config is None:
        config = DEFAULT_CONFIG
    BLOCK_N, NUM_STAGES, SCHED = CONFIGS[config]
    BLOCK_M = 128
    assert q.dtype in _GL_DTYPE and k.dtype == q.dtype and v.dtype == q.dtype
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    B, S, Hq, D = q.shape
    assert k.shape == v.shape and k.shape[0] == B and k.shape[1] == S and k.shape[3] == D
    Hkv = k.shape[2]
    assert D == 128, "spike supports head_dim 128 only"
    assert Hq % Hkv == 0
    assert S >= BLOCK_M and S % BLOCK_M == 0 and S % BLOCK_N == 0, "S must be a multiple of 128"
    if causal and not supports_causal(config):
        raise ValueError(f"config {config} has no causal path (needs BLOCK_N=128, brief order)")
    if m_fastest is None:
        m_fastest = default_m_fastest(causal, S, D, q.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    o = torch.empty_like(q)
    lse = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)
    q_desc, k_desc, v_desc, o_desc = make_descs(q, k, v, o, BLOCK_M, BLOCK_N)
    grid = ((S // BLOCK_M) * B * Hq, )
    global LAST_KERNEL
    LAST_KERNEL = _fa_fwd_hopper_kernel[grid](
        q_desc, k_desc, v_desc, o_desc, lse, scale * _LOG2E, S, Hq, Hq // Hkv,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=D, NUM_STAGES=NUM_STAGES, SCHED=SCHED,
        CAUSAL=bool(causal), M_FASTEST=bool(m_fastest), SINGLE=(S == BLOCK_N), num_warps=8)
    return o, lse
