"""Hopper (sm_90) prefill attention forward in Gluon: warp-specialized (FA3-style), no ping-pong.

The fast path of `longctx.kernels.prefill.flash_attention_fwd` on sm_90 GPUs, for the calls that
`hopper_kernel_applies` accepts there; same contract as the Triton kernel (any lengths, causal
offsets q_start / k_start as ints or [B] tensors, varlen batches, empty rows -> O = 0 and
LSE = -inf). Import it only on a CUDA machine (flash_attention_fwd does so lazily): Gluon has no
interpreter. The masking rule (key-tile bounds, masked softmax step) is kernels/prefill_tiles.py,
Triton functions that the tests also run under the interpreter.

Covers: bf16 / fp16, head_dim 64, 128 or 256 and every multiple of 8 in between (40 .. 248:
split into two power-of-two tiles or padded to the next, below), dense q [B, Sq, Hq, D], k/v
[B, Sk, Hkv, D] or varlen q [total_q, Hq, D], k/v [total_k, Hkv, D] with cu_seqlens, any GQA
group, optionally merging into a running (O, LSE) state (the ring's fused merge, dense only).

Tiles move by TMA, through one of two kinds of descriptors:
  * device (what longctx.attention runs): per program, a descriptor [seqlen, D] over one
    (sequence, head) made on the device (`tma.make_tensor_descriptor`, 128 bytes of global
    scratch each, the producer's Q / K / V and each consumer's O): rows past the sequence's end
    are zero on loads and dropped on stores, whatever follows in memory. Every layout, varlen
    and B > 1 with ragged lengths included; its launch arguments are data pointers and ints, so
    a cached launch (`HopperLaunch`) costs a few µs of host time.
  * host (`mode="host"`, for A/B timing where `descriptor_mode` says it is exact): 2-D
    descriptors [B * S, H * D] made on the host per call, one row per (batch, seq) row (needs
    the heads of a row adjacent, `prefill._tma_rows`). Exact wherever no tile straddles two
    sequences: B == 1 (TMA zero-fills the rows past S on loads and drops them on stores) or Sq
    and Sk multiples of the tiles. On an H200 (bench/check_prefill_hopper.py, 'dev/host') the
    two measured within run-to-run spread of each other: 0.975-1.015 over 9 shapes.
Key columns past seqlen_k are masked to -inf in the scores (their zero-filled V rows then meet
P = 0); query rows past seqlen_q compute on zero rows and are never stored.

One program (CTA) = BLOCK_M = 128 query rows of one (sequence, q head). The query tiles of one
(sequence, head) are adjacent in the grid (they stream the same K/V through the L2), walked
backwards for causal (longest first). Varlen: a tile past a short sequence's end loads and
stores nothing, but still costs a CTA launch (the grid is sized by the longest sequence).
`gl.warp_specialize` splits the CTA into three partitions (12
warps):

  * consumer 0 (the default partition) and consumer 1 (a worker), 4 warps each: query rows
    64 * WG .. 64 * WG + 63 of the tile, wgmma M = 64, setmaxnreg 240 (consumer 0: 232 with
    device-side descriptors, the rest of the register file);
  * producer (a 1-warp worker, setmaxnreg 24, 32 with device-side descriptors): TMA loads of
    the two Q halves, then K_0 and, per tile t, K_{t+1} and V_t into 2-slot rings (tile t in
    slot t % 2).

A program visits key tiles [0, n_tiles); tiles [0, n_full) are visible to every real row of the
tile, [n_full, n_tiles) are masked per row (`prefill_tiles._key_tiles`: the causal band with any
offset delta = q_start - k_start, which may span 2 or 3 key tiles, and the ragged end of the
keys). Producer and consumers derive the tiles from the program id with the same helper, so the
producer loads exactly the tiles the consumers wait for; a program with no tile (rows that see
no key, or past a varlen sequence's end) loads nothing and writes O = 0, LSE = -inf for its
rows.

mbarriers: q_bars[WG] (producer -> consumer WG: its Q half landed; parity 0);
k_full / v_full[slot] (producer -> consumers: slot filled, expect-tx; tile t waits parity
(t // 2) & 1); k_empty / v_empty[slot], count 2 (each consumer warpgroup arrives once after the
wgmma that read the slot has retired; the producer waits parity ((t // 2) & 1) ^ 1 before
loading tile t, so the first two loads of each ring pass at once). An mbarrier.arrive in a
4-warp partition is a partition-wide bar.sync plus one arrive, hence count 2 = two warpgroups.

Consumer order per tile (FA3's, S_0 softmaxed before the loop):
    wait K_{j+1}; issue S_{j+1} = Q K_{j+1}^T; O *= alpha_j; wait V_j; issue O += P_j V_j;
    wait(1) (S_{j+1} done); release K_{j+1}; softmax(S_{j+1}) -> P_{j+1}; wait(0); release V_j
then the last O += P_{n-1} V_{n-1}. S_0 always takes the masked softmax (one tile per program).
In the loop a uniform branch picks the softmax: without any mask arithmetic for the tiles below
n_full, masked for the last ones (usually one: the diagonal, or the ragged key tail). One loop
with the branch, not an unmasked loop followed by a masked one: with two loops carrying P,
ptxas adds 32 PRMTs (swapping the halves of every P register) to each round of both (the
unmasked round then runs 486 instructions instead of the former unmasked kernel's 453; with the
branch 459; the former causal kernel's round, peeled diagonal after its loop, ran 485).

Tiles: BLOCK_N = 128 keys for head_dim 64 and 128; 64 for head_dim 256 (shared memory: Q
128 x 256 and two slots each of K and V, 192 KiB; the fp32 O accumulator is 64 x 256 per
warpgroup, 128 registers a thread) and every head_dim above 128. Gluon tensors are powers of
two, so another head_dim D runs one of two ways (`head_tiles`):
  * split (192 = 128 + 64, 160, 96, 80, 48: the rest above the largest power of two below D is a
    power of two >= 16): Q, K, V and O as two column tiles, BLOCK_D and D_HI wide, each with its
    own device descriptor, shared-memory buffers and TMA loads (one barrier per tile counts
    both); S = Q K^T is two wgmmas (the second accumulating), O += P V two wgmmas into two
    accumulators. No padding: the tensor cores do D's work. Measured against the padded tile
    (bench/prefill_head_split.py, H100): 1.08-1.09x at 96, 1.14-1.25x at 192, 1.15-1.16x at 80,
    1.25-1.39x at 160.
  * padded (40, 56, 72, 88, ...: the rest is not a power of two >= 16): the tile of BLOCK_D = the
    next power of two; the device descriptors span the head's D columns, so TMA zero-fills
    columns D .. BLOCK_D - 1 of Q, K and V in shared memory (they add 0 to Q K^T and give O
    columns that are never stored) and drops them from the O stores; the fused merge masks them.
    The tensor cores then do BLOCK_D / D times the work of D, the softmax no more. Compiled
    (bench/compile_prefill_hopper.py) the padded kernels are the tile's: the same registers,
    shared memory and round loop.
Either way a head_dim that is not a power of two runs device descriptors: host descriptors
([B * S, H * D]) would load the next head's columns into the padding or across the split.

What ptxas does (bench/compile_prefill_hopper.py checks every dispatchable variant): no spills,
no C75xx wgmma-serialization warnings, consumers within their 240 registers. The softmax exp2s
of a warpgroup do NOT run under its own P V wgmma (ptxas retires it before them, see
bench/experiments/gluon_fa_hopper_ws/NOTES.md at commit 1c9b5b5): the overlap is between the two consumer
warpgroups and with the producer's TMA. Ping-pong scheduling and 3 ring slots measured slower.
"""

from __future__ import annotations

import functools

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

from longctx.kernels.launch import Launch
from longctx.kernels.merge import _rescale, _state_lse
from longctx.kernels.prefill import _offset_arg, _set_allocator, _tma_rows
from longctx.kernels.prefill_tiles import (
    DELTA_LIMIT,
    _clamp_delta,
    _key_tiles,
    _row_key_limit,
    _row_lse,
    _softmax_step,
    _softmax_step_masked,
)
from longctx.kernels.utils import FP_FUSION, head_tiles as _head_tiles, next_power_of_2

__all__ = ["hopper_attention_fwd", "HEAD_DIMS"]

# Triton 3.9 renamed Gluon's TMA copies and the CTA barrier (3.6 has only the old names, 3.9
# only the new ones); bench/compile_prefill_hopper.py compiles the kernel with either
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

_LOG2E = 1.4426950408889634
BLOCK_M = 128       # query rows per program
WG_ROWS = 64        # query rows per consumer warpgroup
HEAD_DIMS = (64, 128, 256)  # head_dim tiles; other multiples of 8 in (32, 256]: `head_tiles`
# False: every head_dim runs padded to one tile (the A/B of bench/prefill_head_split.py)
SPLIT_HEADS = True
NUM_STAGES = 2      # K / V ring slots
NUM_WARPS = 4       # the default partition (consumer 0); the workers add 4 + 1 (padded to 4)
CONSUMER_REGS = 240
PRODUCER_REGS = 24
# the producer that makes its descriptors on the device: 24 registers spill there (D=256 varlen,
# once per program); 2 x 128 x 240 + 128 x 32 is the whole register file
PRODUCER_REGS_DEVICE_DESC = 32
_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def head_tiles(head_dim: int) -> tuple[int, int]:
    """(BLOCK_D, D_HI) of head_dim: `kernels.utils.head_tiles`, split unless SPLIT_HEADS is off
    (192 = 128 + 64 runs two tiles; 40 the padded tile of 64)."""
    return _head_tiles(head_dim, SPLIT_HEADS)


def block_n(head_dim: int) -> int:
    """Keys per tile: 128, or 64 for head_dims above 128 (shared memory, see the module
    docstring)."""
    return 64 if head_dim > 128 else 128


# --------------------------------------------------------------------------- #
# Gluon kernel: helpers
# --------------------------------------------------------------------------- #
@gluon.jit
def _program(CU_Q, CU_K, Q_START, K_START, SEQLEN_Q, SEQLEN_K, MAX_SEQLEN_Q, H_Q,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
             VARLEN: gl.constexpr, Q_START_IS_TENSOR: gl.constexpr,
             K_START_IS_TENSOR: gl.constexpr):
    """program -> (b, h, m0, seqlen_q, seqlen_k, q_seq0, k_seq0, delta, n_full, n_tiles): batch
    (sequence) and query head, the tile's first row in its sequence, the sequence's lengths and
    first rows (varlen; 0 when dense), delta = q_start - k_start and the key tiles
    (`_key_tiles`). Producer and consumers both call this."""
    pid = gl.program_id(0)
    num_m = gl.cdiv(MAX_SEQLEN_Q, BLOCK_M)
    # The query tiles of one (sequence, head) adjacent, so that resident programs share its K/V
    # in the L2; causal: walked backwards (longest first). Varlen too: the heads and sequences
    # of one query tile side by side measured 0.83-0.91x the dense kernel's TFLOPS at 24/8 and
    # 32/32 heads (8 sequences, 65536 rows, H200), 0.98 at 16/2.
    bh = pid // num_m
    m_tile = pid % num_m
    if CAUSAL:
        m_tile = num_m - 1 - m_tile
    b = bh // H_Q
    h = bh % H_Q
    if VARLEN:
        q_seq0 = gl.load(CU_Q + b)
        seqlen_q = gl.load(CU_Q + b + 1) - q_seq0
        k_seq0 = gl.load(CU_K + b)
        seqlen_k = gl.load(CU_K + b + 1) - k_seq0
    else:
        q_seq0 = b * 0  # a tensor like the varlen case's (int64 address arithmetic)
        seqlen_q = SEQLEN_Q
        k_seq0 = b * 0
        seqlen_k = SEQLEN_K
    if CAUSAL:
        if Q_START_IS_TENSOR:
            q_start = gl.load(Q_START + b)
        else:
            q_start = Q_START
        if K_START_IS_TENSOR:
            k_start = gl.load(K_START + b)
        else:
            k_start = K_START
        delta = _clamp_delta(q_start, k_start)
    else:
        delta = 0
    m0 = m_tile * BLOCK_M
    n_full, n_tiles = _key_tiles(m0, seqlen_q, seqlen_k, delta, CAUSAL, BLOCK_M, BLOCK_N)
    return b, h, m0, seqlen_q, seqlen_k, q_seq0, k_seq0, delta, n_full, n_tiles


@gluon.jit
def _rows_source(desc, X, b, head, seq0, seqlen, seqlen_dense, stride_b, stride_s, stride_h,
                 BLOCK_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr,
                 LAYOUT: gl.constexpr, DEVICE_DESC: gl.constexpr):
    """(descriptor, row, column) of the sequence's row 0 of one head of X, in [BLOCK_ROWS,
    BLOCK_D] boxes: the host descriptor [B * S, H * D] (row b * S, column head * D; D ==
    BLOCK_D) or one made here over the (sequence, head) [seqlen, D] (row 0, column 0), whose
    columns past D (a padded head_dim) are zero on loads and dropped on stores."""
    if DEVICE_DESC:
        base = (X + b.to(gl.int64) * stride_b + seq0.to(gl.int64) * stride_s
                + head.to(gl.int64) * stride_h)
        d = tma.make_tensor_descriptor(base, [seqlen, HEAD_DIM], [stride_s, 1],
                                       [BLOCK_ROWS, BLOCK_D], LAYOUT)
        return d, 0, 0
    else:
        return desc, b * seqlen_dense, head * HEAD_DIM


@gluon.jit
def _load_tile(desc, smem, desc_hi, smem_hi, full, empty, t, row0, col, BLOCK_N: gl.constexpr,
               NUM_STAGES: gl.constexpr, D_HI: gl.constexpr):
    """Producer: wait until ring slot t % NS is free, then TMA-load key tile t into it (and its
    columns BLOCK_D .. D - 1 into smem_hi, a split head: device descriptors, row 0 column 0)."""
    slot = t % NUM_STAGES
    mbarrier.wait(empty.index(slot), ((t // NUM_STAGES) & 1) ^ 1)
    if D_HI > 0:
        mbarrier.expect(full.index(slot), desc.block_type.nbytes + desc_hi.block_type.nbytes)
    else:
        mbarrier.expect(full.index(slot), desc.block_type.nbytes)
    _tma_load(desc, [row0 + t * BLOCK_N, col], full.index(slot), smem.index(slot))
    if D_HI > 0:
        _tma_load(desc_hi, [t * BLOCK_N, 0], full.index(slot), smem_hi.index(slot))


@gluon.jit
def _round(j, q, p_op, acc, alpha, m_i, l_i, qk_scale, k_smem, v_smem, k_full, k_empty, v_full,
           v_empty, s_zero, cols, row_lim, n_full, q_hi, acc_hi, k_hi, v_hi,
           NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr, D_HI: gl.constexpr,
           o_layout: gl.constexpr, o_hi_layout: gl.constexpr, p_layout: gl.constexpr,
           dtype: gl.constexpr):
    """FA3-order round j + 1: S_{j+1} = Q K_{j+1}^T and O = alpha_j O + P_j V_j on the tensor
    cores, softmax of S_{j+1} (masked by the rows' key limits `row_lim` from key tile n_full on)
    -> P_{j+1}, alpha_{j+1}. A split head (D_HI > 0) adds its high columns: a second wgmma into
    S (use_acc) and a second accumulator acc_hi."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    t = j + 1
    ks = t % NUM_STAGES
    mbarrier.wait(k_full.index(ks), (t // NUM_STAGES) & 1)
    s_tok = warpgroup_mma(q, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    if D_HI > 0:
        s_tok = warpgroup_mma(q_hi, k_hi.index(ks).permute((1, 0)), s_tok, is_async=True)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    if D_HI > 0:
        acc_hi = acc_hi * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_hi_layout)),
                                         1)
    vs = j % NUM_STAGES
    mbarrier.wait(v_full.index(vs), (j // NUM_STAGES) & 1)
    acc_tok = warpgroup_mma(p_op, v_smem.index(vs), acc, is_async=True)
    if D_HI > 0:
        acc_hi_tok = warpgroup_mma(p_op, v_hi.index(vs), acc_hi, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=2, deps=(s_tok, ))
    else:
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(ks), count=1)
    if t >= n_full:
        p, alpha, m_i, l_i = _softmax_step_masked(s, cols, row_lim - t * BLOCK_N, m_i, l_i,
                                                  qk_scale)
    else:
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
    if D_HI > 0:
        acc, acc_hi, p_op = warpgroup_mma_wait(num_outstanding=0,
                                               deps=(acc_tok, acc_hi_tok, p_op))
    else:
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, p_op))
    mbarrier.arrive(v_empty.index(vs), count=1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    return acc, acc_hi, p_op, alpha, m_i, l_i


@gluon.jit
def _merge_into_state(o, o_hi, lse, rows, O_ACC, LSE_ACC, b, h, seqlen_q, stride_ob, stride_os,
                      stride_oh, stride_lb, stride_ls, stride_lh, HEAD_DIM: gl.constexpr,
                      BLOCK_D: gl.constexpr, D_HI: gl.constexpr, o_layout: gl.constexpr,
                      o_hi_layout: gl.constexpr):
    """Fold a warpgroup's state (o [ROWS, BLOCK_D] normalised fp32 (and a split head's columns
    BLOCK_D .. BLOCK_D + D_HI - 1 in o_hi), lse [ROWS] natural log, of in-sequence query rows
    `rows`) into the running state O_ACC [B, Sq, Hq, D] / LSE_ACC [B, Sq, Hq] float32 (strides
    given), in place; rows >= seqlen_q and columns >= D (a padded head_dim) are left alone.

    kernels/prefill.py's ACCUMULATE epilogue: merge_into's rule through the merge layer's own
    `_rescale` / `_state_lse` (kernels/merge.py; Triton functions, callable from Gluon). Each
    (row, head) belongs to exactly one warpgroup of one program.
    """
    row_ok = rows < seqlen_q
    rows64 = rows.to(gl.int64)
    cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    l_ptrs = LSE_ACC + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + rows64 * stride_ls
    o_ptrs = (O_ACC + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
              + gl.expand_dims(rows64 * stride_os, 1) + gl.expand_dims(cols, 0))
    lse_old = gl.load(l_ptrs, mask=row_ok, other=float("-inf"))
    m = gl.maximum(lse_old, lse)
    w_old, w_new = _rescale(lse_old, m, lse)
    # an empty running state (w_old == 0) is never read: its O may be anything, NaN included
    old_ok = gl.expand_dims((w_old > 0) & row_ok, 1)
    new_ok = gl.expand_dims(row_ok, 1)
    if HEAD_DIM < BLOCK_D:  # padded
        old_ok = old_ok & gl.expand_dims(cols < HEAD_DIM, 0)
        new_ok = new_ok & gl.expand_dims(cols < HEAD_DIM, 0)
    s = w_old + w_new
    o = _merged(o, gl.load(o_ptrs, mask=old_ok, other=0.0), w_old, w_new, s)
    if D_HI > 0:  # a split head's columns BLOCK_D .. BLOCK_D + D_HI - 1, the same rule
        row_hi: gl.constexpr = gl.SliceLayout(1, o_hi_layout)
        cols_hi = BLOCK_D + gl.arange(0, D_HI, layout=gl.SliceLayout(0, o_hi_layout))
        row_ok_hi = gl.convert_layout(row_ok, row_hi)
        w_old_hi = gl.convert_layout(w_old, row_hi)
        o_hi_ptrs = (O_ACC + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
                     + gl.expand_dims(gl.convert_layout(rows64, row_hi) * stride_os, 1)
                     + gl.expand_dims(cols_hi, 0))
        o_hi_old = gl.load(o_hi_ptrs, mask=gl.expand_dims((w_old_hi > 0) & row_ok_hi, 1),
                           other=0.0)
        o_hi = _merged(o_hi, o_hi_old, w_old_hi, gl.convert_layout(w_new, row_hi),
                       gl.convert_layout(s, row_hi))
    # Every thread of the warpgroup has read the old LSE (each row's LSE is held by several
    # threads, one of which stores it) before any overwrites it. Inside a partition this is a
    # named barrier over the partition's 128 threads.
    _cta_barrier()
    gl.store(o_ptrs, o, mask=new_ok)
    if D_HI > 0:
        gl.store(o_hi_ptrs, o_hi, mask=gl.expand_dims(row_ok_hi, 1))
    gl.store(l_ptrs, _state_lse(m, s), mask=row_ok)


@gluon.jit
def _merged(o, o_old, w_old, w_new, s):
    """merge_into's weighted mean of the new (o) and old rows, weights per row."""
    return ((o_old * gl.expand_dims(w_old, 1) + o * gl.expand_dims(w_new, 1))
            / gl.expand_dims(gl.where(s > 0, s, 1.0), 1))


# --------------------------------------------------------------------------- #
# Gluon kernel: partitions
# --------------------------------------------------------------------------- #
@gluon.jit
def _producer(q_desc, k_desc, v_desc, Q, K, V, q_smem, k_smem, v_smem, hi_smem, bars, CU_Q, CU_K,
              Q_START, K_START, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
              stride_vb, stride_vs, stride_vh, SEQLEN_Q, SEQLEN_K, MAX_SEQLEN_Q, H_Q, GROUP,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              BLOCK_D: gl.constexpr, D_HI: gl.constexpr, NUM_STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, VARLEN: gl.constexpr, DEVICE_DESC: gl.constexpr,
              Q_START_IS_TENSOR: gl.constexpr, K_START_IS_TENSOR: gl.constexpr,
              Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr, Q_HI_LAYOUT: gl.constexpr,
              KV_HI_LAYOUT: gl.constexpr):
    """1 warp: Q halves, then K_0, (K_{t+1}, V_t) for t < n_tiles - 1, V_{n_tiles-1}: K runs
    one tile ahead of V, as round j of the consumers needs K_{j+1} before V_j. Nothing when the
    program has no key tile. A split head loads its high columns with the same barriers."""
    q_bars, k_full, k_empty, v_full, v_empty = bars
    q_hi, k_hi, v_hi = hi_smem
    b, h, m0, seqlen_q, seqlen_k, q_seq0, k_seq0, delta, n_full, n_tiles = _program(
        CU_Q, CU_K, Q_START, K_START, SEQLEN_Q, SEQLEN_K, MAX_SEQLEN_Q, H_Q, BLOCK_M, BLOCK_N,
        CAUSAL, VARLEN, Q_START_IS_TENSOR, K_START_IS_TENSOR)
    if n_tiles > 0:
        # device mode: each descriptor is made right before its first load, so that making the
        # next one overlaps the loads already issued
        qd, q_row, q_col = _rows_source(q_desc, Q, b, h, q_seq0, seqlen_q, SEQLEN_Q, stride_qb,
                                        stride_qs, stride_qh, BLOCK_M // 2, HEAD_DIM, BLOCK_D,
                                        Q_LAYOUT, DEVICE_DESC)
        qd_hi = qd
        if D_HI > 0:
            qd_hi, _, _ = _rows_source(q_desc, Q + BLOCK_D, b, h, q_seq0, seqlen_q, SEQLEN_Q,
                                       stride_qb, stride_qs, stride_qh, BLOCK_M // 2, D_HI, D_HI,
                                       Q_HI_LAYOUT, DEVICE_DESC)
        for wg in gl.static_range(2):
            row = q_row + m0 + wg * (BLOCK_M // 2)
            if D_HI > 0:
                mbarrier.expect(q_bars.index(wg),
                                qd.block_type.nbytes + qd_hi.block_type.nbytes)
            else:
                mbarrier.expect(q_bars.index(wg), qd.block_type.nbytes)
            _tma_load(qd, [row, q_col], q_bars.index(wg), q_smem.index(wg))
            if D_HI > 0:
                _tma_load(qd_hi, [row, 0], q_bars.index(wg), q_hi.index(wg))
        kvh = h // GROUP
        kd, kv_row, kv_col = _rows_source(k_desc, K, b, kvh, k_seq0, seqlen_k, SEQLEN_K,
                                          stride_kb, stride_ks, stride_kh, BLOCK_N, HEAD_DIM,
                                          BLOCK_D, KV_LAYOUT, DEVICE_DESC)
        kd_hi = kd
        if D_HI > 0:
            kd_hi, _, _ = _rows_source(k_desc, K + BLOCK_D, b, kvh, k_seq0, seqlen_k, SEQLEN_K,
                                       stride_kb, stride_ks, stride_kh, BLOCK_N, D_HI, D_HI,
                                       KV_HI_LAYOUT, DEVICE_DESC)
        _load_tile(kd, k_smem, kd_hi, k_hi, k_full, k_empty, 0, kv_row, kv_col, BLOCK_N,
                   NUM_STAGES, D_HI)
        vd, kv_row, kv_col = _rows_source(v_desc, V, b, kvh, k_seq0, seqlen_k, SEQLEN_K,
                                          stride_vb, stride_vs, stride_vh, BLOCK_N, HEAD_DIM,
                                          BLOCK_D, KV_LAYOUT, DEVICE_DESC)
        vd_hi = vd
        if D_HI > 0:
            vd_hi, _, _ = _rows_source(v_desc, V + BLOCK_D, b, kvh, k_seq0, seqlen_k, SEQLEN_K,
                                       stride_vb, stride_vs, stride_vh, BLOCK_N, D_HI, D_HI,
                                       KV_HI_LAYOUT, DEVICE_DESC)
        for t in range(n_tiles - 1):
            _load_tile(kd, k_smem, kd_hi, k_hi, k_full, k_empty, t + 1, kv_row, kv_col, BLOCK_N,
                       NUM_STAGES, D_HI)
            _load_tile(vd, v_smem, vd_hi, v_hi, v_full, v_empty, t, kv_row, kv_col, BLOCK_N,
                       NUM_STAGES, D_HI)
        _load_tile(vd, v_smem, vd_hi, v_hi, v_full, v_empty, n_tiles - 1, kv_row, kv_col,
                   BLOCK_N, NUM_STAGES, D_HI)


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, hi_smem, bars, o_desc, O, LSE, CU_Q, CU_K, Q_START,
              K_START, stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
              qk_scale, SEQLEN_Q, SEQLEN_K, MAX_SEQLEN_Q, H_Q, WG: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              BLOCK_D: gl.constexpr, D_HI: gl.constexpr, NUM_STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, VARLEN: gl.constexpr, DEVICE_DESC: gl.constexpr,
              Q_START_IS_TENSOR: gl.constexpr, K_START_IS_TENSOR: gl.constexpr,
              ACCUMULATE: gl.constexpr, Q_LAYOUT: gl.constexpr, Q_HI_LAYOUT: gl.constexpr):
    """One warpgroup: query rows WG * 64 .. WG * 64 + 63 of the program's tile."""
    ROWS: gl.constexpr = BLOCK_M // 2
    q_bars, k_full, k_empty, v_full, v_empty = bars
    q_hi_smem, k_hi, v_hi = hi_smem
    dtype: gl.constexpr = q_smem.dtype
    b, h, m0, seqlen_q, seqlen_k, q_seq0, k_seq0, delta, n_full, n_tiles = _program(
        CU_Q, CU_K, Q_START, K_START, SEQLEN_Q, SEQLEN_K, MAX_SEQLEN_Q, H_Q, BLOCK_M, BLOCK_N,
        CAUSAL, VARLEN, Q_START_IS_TENSOR, K_START_IS_TENSOR)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_D, 16])
    # a split head's high columns: their own accumulator (unused, and a copy of o_layout, when
    # the head is one tile)
    o_hi_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D_HI if D_HI > 0 else BLOCK_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    row_o_hi: gl.constexpr = gl.SliceLayout(1, o_hi_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([ROWS], gl.float32, row_s)
    acc = gl.zeros([ROWS, BLOCK_D], gl.float32, o_layout)
    if D_HI > 0:
        acc_hi = gl.zeros([ROWS, D_HI], gl.float32, o_hi_layout)
    else:
        acc_hi = acc  # carried through the rounds untouched (the loop drops it)
    q = q_smem.index(WG)
    q_hi = q_hi_smem.index(WG)
    row0 = m0 + WG * ROWS  # this warpgroup's first row in the sequence
    if not ACCUMULATE:
        # device mode: made here, while the producer's first loads are in flight (a sequence
        # with no rows gets a 1-row descriptor that is never used)
        od, o_row, o_col = _rows_source(o_desc, O, b, h, q_seq0, gl.maximum(seqlen_q, 1),
                                        SEQLEN_Q, stride_ob, stride_os, stride_oh, ROWS, HEAD_DIM,
                                        BLOCK_D, Q_LAYOUT, DEVICE_DESC)
        od_hi = od
        if D_HI > 0:
            od_hi, _, _ = _rows_source(o_desc, O + BLOCK_D, b, h, q_seq0,
                                       gl.maximum(seqlen_q, 1), SEQLEN_Q, stride_ob, stride_os,
                                       stride_oh, ROWS, D_HI, D_HI, Q_HI_LAYOUT, DEVICE_DESC)

    if n_tiles > 0:
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        row_lim = _row_key_limit(row0 + gl.arange(0, ROWS, layout=row_s), seqlen_k, delta,
                                 CAUSAL)
        mbarrier.wait(q_bars.index(WG), 0)

        # ---- S_0, masked (the one tile of a short program may be the band or the tail) ------
        mbarrier.wait(k_full.index(0), 0)
        s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        if D_HI > 0:
            s_tok = warpgroup_mma(q_hi, k_hi.index(0).permute((1, 0)), s_tok, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(0), count=1)
        p, alpha, m_i, l_i = _softmax_step_masked(s, cols, row_lim, m_i, l_i, qk_scale)
        p_op = gl.convert_layout(p.to(dtype), p_layout)

        # ---- rounds 1 .. n_tiles - 1 (unmasked key tiles, then masked ones) ----------------
        for j in range(0, n_tiles - 1):
            acc, acc_hi, p_op, alpha, m_i, l_i = _round(
                j, q, p_op, acc, alpha, m_i, l_i, qk_scale, k_smem, v_smem, k_full, k_empty,
                v_full, v_empty, s_zero, cols, row_lim, n_full, q_hi, acc_hi, k_hi, v_hi,
                NUM_STAGES, BLOCK_N, D_HI, o_layout, o_hi_layout, p_layout, dtype)

        # ---- the last P V -------------------------------------------------------------------
        j = n_tiles - 1
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        if D_HI > 0:
            acc_hi = acc_hi * gl.expand_dims(gl.convert_layout(alpha, row_o_hi), 1)
        vs = j % NUM_STAGES
        mbarrier.wait(v_full.index(vs), (j // NUM_STAGES) & 1)
        acc_tok = warpgroup_mma(p_op, v_smem.index(vs), acc, is_async=True)
        if D_HI > 0:
            acc_hi_tok = warpgroup_mma(p_op, v_hi.index(vs), acc_hi, is_async=True)
            acc, acc_hi, p_op = warpgroup_mma_wait(num_outstanding=0,
                                                   deps=(acc_tok, acc_hi_tok, p_op))
        else:
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, p_op))
        mbarrier.arrive(v_empty.index(vs), count=1)

    # ---- epilogue: O /= l, LSE = (m + log2 l) ln 2; rows that saw no key: O = 0, LSE = -inf --
    if row0 < seqlen_q:
        l_o = gl.convert_layout(l_i, row_o)
        acc = acc / gl.expand_dims(gl.where(l_o == 0.0, 1.0, l_o), 1)
        if D_HI > 0:
            l_o_hi = gl.convert_layout(l_i, row_o_hi)
            acc_hi = acc_hi / gl.expand_dims(gl.where(l_o_hi == 0.0, 1.0, l_o_hi), 1)
        lse = _row_lse(m_i, l_i)
        if ACCUMULATE:
            _merge_into_state(acc, acc_hi, gl.convert_layout(lse, row_o),
                              row0 + gl.arange(0, ROWS, layout=row_o), O, LSE, b, h, seqlen_q,
                              stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                              HEAD_DIM, BLOCK_D, D_HI, o_layout, o_hi_layout)
        else:
            rows = row0 + gl.arange(0, ROWS, layout=row_s)
            l_ptrs = (LSE + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
                      + (q_seq0 + rows).to(gl.int64) * stride_ls)
            gl.store(l_ptrs, lse, mask=rows < seqlen_q)
            # O through this warpgroup's Q half (its S GEMMs have all retired) and a TMA store;
            # rows past the sequence's end are dropped by the descriptor's bounds
            q.store(acc.to(dtype))
            if D_HI > 0:
                q_hi.store(acc_hi.to(dtype))
            fence_async_shared()
            _tma_store(od, [o_row + row0, o_col], q)
            if D_HI > 0:
                _tma_store(od_hi, [row0, 0], q_hi)
            tma.store_wait(pendings=0)


@gluon.jit(do_not_specialize=["Q_START", "K_START", "SEQLEN_Q", "SEQLEN_K", "MAX_SEQLEN_Q"])
def _attn_fwd_hopper_kernel(
    # What changes from call to call leads (a Launch's dynamic arguments, kernels/launch.py):
    Q, K, V,                  # q / k / v (device mode: the descriptors' bases)
    O,                        # output (device mode's O descriptors) or ACCUMULATE's O_ACC
    LSE,                      # float32 output [B, Sq, Hq] / [total_q, Hq], or ACCUMULATE's state
    Q_START, K_START,         # CAUSAL: ints or int32/int64 [B] pointers (*_IS_TENSOR)
    CU_Q, CU_K,               # VARLEN: int32 [B + 1] sequence starts; else None
    q_desc,                   # host mode: TMA descriptor over [B * Sq, Hq * D], [64, D] boxes
    k_desc, v_desc,           # host mode: over [B * Sk, Hkv * D], [BLOCK_N, D] boxes
    o_desc,                   # host mode: like q_desc over O; device mode / ACCUMULATE: None
    stride_qb, stride_qs, stride_qh,   # element strides (head_dim's is 1; batch's 0 for varlen)
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,   # of O (device mode) / O_ACC (ACCUMULATE)
    stride_lb, stride_ls, stride_lh,   # of LSE
    qk_scale,                 # softmax_scale * log2(e)
    SEQLEN_Q, SEQLEN_K,       # dense lengths (VARLEN: unused)
    MAX_SEQLEN_Q,             # sizes the grid: cdiv(MAX_SEQLEN_Q, BLOCK_M) query tiles per head
    H_Q, GROUP,               # query heads, Hq // Hkv
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_D: gl.constexpr,    # HEAD_DIM's (first) tile (`head_tiles`; device descriptors pad it)
    D_HI: gl.constexpr,       # a split head's second tile, columns BLOCK_D .. HEAD_DIM - 1; or 0
    NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, ACCUMULATE: gl.constexpr,
    VARLEN: gl.constexpr, DEVICE_DESC: gl.constexpr,
    Q_START_IS_TENSOR: gl.constexpr, K_START_IS_TENSOR: gl.constexpr,
    Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr,
    Q_HI_LAYOUT: gl.constexpr, KV_HI_LAYOUT: gl.constexpr,  # D_HI's tiles (else Q/KV_LAYOUT)
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """grid = (B * Hq * cdiv(MAX_SEQLEN_Q, BLOCK_M),), num_warps = 4 (the default partition =
    consumer 0)."""
    gl.static_assert(BLOCK_M == 128)
    # host descriptors over [B * S, H * D] would read the next head's columns into the padding
    gl.static_assert(DEVICE_DESC or HEAD_DIM == BLOCK_D)
    gl.static_assert(D_HI == 0 or HEAD_DIM == BLOCK_D + D_HI)
    dtype: gl.constexpr = Q.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M // 2, BLOCK_D], Q_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_D], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_D], KV_LAYOUT)
    if D_HI > 0:
        hi_smem = (gl.allocate_shared_memory(dtype, [2, BLOCK_M // 2, D_HI], Q_HI_LAYOUT),
                   gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D_HI], KV_HI_LAYOUT),
                   gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D_HI], KV_HI_LAYOUT))
    else:
        hi_smem = (q_smem, k_smem, v_smem)  # never read
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
        (_consumer, (q_smem, k_smem, v_smem, hi_smem, bars, o_desc, O, LSE, CU_Q, CU_K, Q_START,
                     K_START, stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                     qk_scale, SEQLEN_Q, SEQLEN_K, MAX_SEQLEN_Q, H_Q, 0, BLOCK_M, BLOCK_N,
                     HEAD_DIM, BLOCK_D, D_HI, NUM_STAGES, CAUSAL, VARLEN, DEVICE_DESC,
                     Q_START_IS_TENSOR, K_START_IS_TENSOR, ACCUMULATE, Q_LAYOUT, Q_HI_LAYOUT)),
        (_consumer, (q_smem, k_smem, v_smem, hi_smem, bars, o_desc, O, LSE, CU_Q, CU_K, Q_START,
                     K_START, stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                     qk_scale, SEQLEN_Q, SEQLEN_K, MAX_SEQLEN_Q, H_Q, 1, BLOCK_M, BLOCK_N,
                     HEAD_DIM, BLOCK_D, D_HI, NUM_STAGES, CAUSAL, VARLEN, DEVICE_DESC,
                     Q_START_IS_TENSOR, K_START_IS_TENSOR, ACCUMULATE, Q_LAYOUT, Q_HI_LAYOUT)),
        (_producer, (q_desc, k_desc, v_desc, Q, K, V, q_smem, k_smem, v_smem, hi_smem, bars,
                     CU_Q, CU_K, Q_START, K_START, stride_qb, stride_qs, stride_qh, stride_kb,
                     stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, SEQLEN_Q, SEQLEN_K,
                     MAX_SEQLEN_Q, H_Q, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, D_HI,
                     NUM_STAGES, CAUSAL, VARLEN, DEVICE_DESC, Q_START_IS_TENSOR,
                     K_START_IS_TENSOR, Q_LAYOUT, KV_LAYOUT, Q_HI_LAYOUT, KV_HI_LAYOUT)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------- #
# Python entry point
# --------------------------------------------------------------------------- #
def descriptor_mode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: bool) -> str:
    """"host" where 2-D host descriptors over (batch, seq) rows are exact for this call (q, k, v
    rows form them, `prefill._tma_rows`, and no tile straddles two sequences: B == 1 or Sq and
    Sk multiples of the tiles), else "device" (per-program descriptors over each sequence)."""
    if varlen:
        return "device"
    if not all(_tma_rows(tuple(x.shape), x.stride(), x.element_size(), x.data_ptr())
               for x in (q, k, v)):
        return "device"
    batch, sq, _, d = q.shape
    if d != next_power_of_2(d):  # a padded or split tile would read the next head's columns
        return "device"
    if batch == 1 or (sq % BLOCK_M == 0 and k.shape[1] % block_n(d) == 0):
        return "host"
    return "device"


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, head_dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a [rows, head_dim] tile (TMA box and wgmma operand)."""
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], _GL_DTYPE[dtype])


def _rows_desc(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """TMA descriptor over x [B, S, H, D] as the 2-D [B * S, H * D] (row stride: x's seq stride)."""
    b, s, h, d = x.shape
    return TensorDescriptor(x, [b * s, h * d], [x.stride(1), 1], [block_rows, d],
                            _smem_layout(block_rows, d, x.dtype))


def _causal_delta(q_start: int, k_start: int) -> int:
    """Two int offsets as the kernel takes them: q_start - k_start, clamped to +-DELTA_LIMIT
    (no 64-bit parameters, one specialisation; sequences are shorter, so what each query sees
    is unchanged)."""
    return max(-DELTA_LIMIT, min(DELTA_LIMIT, q_start - k_start))


def _kernel_offsets(causal: bool, q_start: int | torch.Tensor, k_start: int | torch.Tensor,
                    batch: int, device: torch.device) -> tuple:
    """(Q_START, Q_START_IS_TENSOR, K_START, K_START_IS_TENSOR) as the kernel takes them: two
    ints become one clamped delta (`_causal_delta`); without causal the offsets are ignored."""
    if not causal:
        return 0, False, 0, False
    qs, qs_t = _offset_arg(q_start, batch, device, "q_start")
    ks, ks_t = _offset_arg(k_start, batch, device, "k_start")
    if not (qs_t or ks_t):
        qs, ks = _causal_delta(qs, ks), 0
    return qs, qs_t, ks, ks_t


def launch_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    accumulate: tuple[torch.Tensor, torch.Tensor] | None,
    q_start: int | torch.Tensor = 0,
    k_start: int | torch.Tensor = 0,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    mode: str | None = None,
) -> tuple[tuple[int], tuple, dict, tuple[torch.Tensor, torch.Tensor] | None]:
    """(grid, args, constexpr kwargs, (o, lse) or None) of one kernel launch; allocates o and lse
    unless accumulating. mode: "device" (default) or "host" descriptors (where
    `descriptor_mode` says they are exact).
    Shared with bench/compile_prefill_hopper.py, which compiles exactly the specialisations that
    launches with given tensors get. q_start / k_start: ints or [B] int32/int64 tensors on
    q's device (causal only; without causal they are ignored)."""
    varlen = cu_seqlens_q is not None
    if varlen and (cu_seqlens_k is None or max_seqlen_q is None):
        raise ValueError("varlen needs cu_seqlens_k and max_seqlen_q (it sizes the grid)")
    if mode not in (None, "host", "device") or (
            mode == "host" and descriptor_mode(q, k, v, varlen) != "host"):
        raise ValueError(f"mode must be None, 'device' or, where the host descriptors are exact "
                         f"for this call, 'host'; got {mode!r}")
    mode = mode or "device"
    if varlen:
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
        total_q, hq, d = q.shape
        hkv = k.shape[1]
        batch = cu_seqlens_q.numel() - 1
        sq = sk = 0
        (sqs, sqh, _), (sks, skh, _), (svs, svh, _) = q.stride(), k.stride(), v.stride()
        sqb = skb = svb = 0
        o = torch.empty((total_q, hq, d), dtype=q.dtype, device=q.device)
        lse = torch.empty((total_q, hq), dtype=torch.float32, device=q.device)
        o_strides = (0, o.stride(0), o.stride(1))
        l_strides = (0, lse.stride(0), 1)
        out = (o, lse)
    else:
        batch, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        max_seqlen_q = sq
        (sqb, sqs, sqh, _), (skb, sks, skh, _), (svb, svs, svh, _) = (
            q.stride(), k.stride(), v.stride())
        if accumulate is None:
            o = torch.empty((batch, sq, hq, d), dtype=q.dtype, device=q.device)
            lse = torch.empty((batch, sq, hq), dtype=torch.float32, device=q.device)
            out = (o, lse)
        else:
            o, lse = accumulate
            out = None
        l_strides = lse.stride()  # [B, Sq, Hq]: (batch, seq, head)
        o_strides = o.stride()[:3]
    bn, (bd, d_hi) = block_n(d), head_tiles(d)
    host = mode == "host"
    q_layout, kv_layout = _smem_layout(WG_ROWS, bd, q.dtype), _smem_layout(bn, bd, q.dtype)
    q_hi_layout, kv_hi_layout = ((_smem_layout(WG_ROWS, d_hi, q.dtype),
                                  _smem_layout(bn, d_hi, q.dtype)) if d_hi
                                 else (q_layout, kv_layout))
    descs = ((_rows_desc(q, WG_ROWS), _rows_desc(k, bn), _rows_desc(v, bn),
              _rows_desc(o, WG_ROWS) if accumulate is None else None) if host
             else (None, None, None, None))
    qs, qs_t, ks, ks_t = _kernel_offsets(causal, q_start, k_start, batch, q.device)
    args = (q, k, v, o, lse, qs, ks, cu_seqlens_q, cu_seqlens_k, *descs,
            sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, *o_strides, *l_strides,
            float(softmax_scale) * _LOG2E, sq, sk, max_seqlen_q, hq, hq // hkv)
    meta = dict(BLOCK_M=BLOCK_M, BLOCK_N=bn, HEAD_DIM=d, BLOCK_D=bd, D_HI=d_hi,
                NUM_STAGES=NUM_STAGES, CAUSAL=bool(causal), ACCUMULATE=accumulate is not None,
                VARLEN=varlen, DEVICE_DESC=not host, Q_START_IS_TENSOR=qs_t,
                K_START_IS_TENSOR=ks_t, Q_LAYOUT=q_layout, KV_LAYOUT=kv_layout,
                Q_HI_LAYOUT=q_hi_layout, KV_HI_LAYOUT=kv_hi_layout,
                CONSUMER_REGS=CONSUMER_REGS,
                PRODUCER_REGS=PRODUCER_REGS if host else PRODUCER_REGS_DEVICE_DESC,
                num_warps=NUM_WARPS, **FP_FUSION)
    grid = (batch * hq * -(-max_seqlen_q // BLOCK_M),)
    return grid, args, meta, out


class HopperLaunch:
    """The Gluon kernel's launch for one input signature (device-side descriptors), computed once:
    what `longctx.kernels.prefill.PrefillPlan` runs where the Hopper dispatch applies. Built like
    `launch_args` (whose launch it is) from the shapes, strides, dtypes, flags and the offsets'
    types; a call passes the data pointers and offsets (kernels/launch.py's Launch)."""

    __slots__ = ("launch", "causal", "varlen", "batch")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                 causal: bool, accumulate: tuple[torch.Tensor, torch.Tensor] | None,
                 q_start: int | torch.Tensor, k_start: int | torch.Tensor,
                 cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
                 max_seqlen_q: int | None) -> None:
        grid, args, meta, _ = launch_args(q, k, v, softmax_scale, causal, accumulate, q_start,
                                          k_start, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          mode="device")
        self.causal, self.varlen = bool(causal), cu_seqlens_q is not None
        self.batch = cu_seqlens_q.numel() - 1 if self.varlen else q.shape[0]
        n = 9 if self.varlen else 7  # Q, K, V, O, LSE, Q_START, K_START[, CU_Q, CU_K]
        dyn_dtypes = [x.dtype if isinstance(x, torch.Tensor) else None for x in args[:n]]
        self.launch = Launch(_attn_fwd_hopper_kernel, grid, dyn_dtypes, args[n:], meta)

    def generic(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                lse: torch.Tensor, q_start: int | torch.Tensor, k_start: int | torch.Tensor,
                cu_q: torch.Tensor | None, cu_k: torch.Tensor | None) -> None:
        """Launch into o / lse (or the accumulator) through Triton's path."""
        qs, _, ks, _ = _kernel_offsets(self.causal, q_start, k_start, self.batch, q.device)
        _set_allocator()  # descriptors made on the device need 128 bytes of global scratch each
        self.launch.generic(q, k, v, o, lse, qs, ks, *((cu_q, cu_k) if self.varlen else ()))

    def __call__(self, ptrs: tuple[int, int, int, int, int], q_start: int | torch.Tensor,
                 k_start: int | torch.Tensor, cu_q: torch.Tensor | None,
                 cu_k: torch.Tensor | None, q_device: torch.device, device: int) -> None:
        """Launch on CUDA device `device` (the current one; q is on q_device): ptrs = the data
        pointers of q, k, v, o (or the accumulator's O) and the LSE. The descriptors' scratch
        comes with the launch (kernels/launch.py)."""
        if not self.causal:
            dyn = ptrs + (0, 0)
        elif type(q_start) is int and type(k_start) is int:  # checked when the plan was made
            dyn = ptrs + (_causal_delta(q_start, k_start), 0)
        else:
            qs, qs_t, ks, ks_t = _kernel_offsets(True, q_start, k_start, self.batch, q_device)
            dyn = ptrs + (qs.data_ptr() if qs_t else qs, ks.data_ptr() if ks_t else ks)
        if self.varlen:
            dyn += (cu_q.data_ptr(), cu_k.data_ptr())
        self.launch(dyn, device)


def hopper_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    q_start: int | torch.Tensor = 0,
    k_start: int | torch.Tensor = 0,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    accumulate: tuple[torch.Tensor, torch.Tensor] | None = None,
    mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Attention forward on Hopper returning (O, LSE), or merging them into a running state.

    Dense:  q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]
            -> o [B, Sq, Hq, D] (q.dtype), lse [B, Sq, Hq] float32 (natural log).
    Varlen: q [total_q, Hq, D], k/v [total_k, Hkv, D], cu_seqlens_q/k int32 [B + 1] on q's
            device, max_seqlen_q a python int >= every sequence's query length
            -> o [total_q, Hq, D], lse [total_q, Hq].
    bf16 or fp16, D a multiple of 8 whose tile (the next power of two) is in HEAD_DIMS (split or
    padded: `head_tiles`), on an sm_90 GPU; causal: row i sees key j iff k_start + j <=
    q_start + i (ints or [B] int tensors); rows that see no key get O = 0 and LSE = -inf.

    Only for the inputs that `longctx.kernels.prefill.hopper_kernel_applies` accepts (TMA-
    addressable rows, see the module docstring); the launch does not re-check them. mode:
    "device" (the default: descriptors made on the device, what longctx.attention runs) or
    "host" descriptors, for A/B timing where `descriptor_mode` says they are exact.

    accumulate (dense only): (o_acc [B, Sq, Hq, D] float32, lse_acc [B, Sq, Hq] float32), a
    running state as `longctx.merge.merge_into` keeps it; the result is merged into it in place
    (rule and barrier of kernels/prefill.py's ACCUMULATE epilogue; o_acc is never read where
    lse_acc is -inf) and nothing is returned.
    """
    grid, args, meta, out = launch_args(q, k, v, softmax_scale, causal, accumulate, q_start,
                                        k_start, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, mode)
    if grid[0] == 0:
        if out is not None:
            out[0].zero_()
            out[1].fill_(float("-inf"))
        return out
    if meta["DEVICE_DESC"]:
        _set_allocator()  # descriptors made on the device need 128 bytes of global scratch each
    _attn_fwd_hopper_kernel[grid](*args, **meta)
    return out
