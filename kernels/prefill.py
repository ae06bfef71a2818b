"""FlashAttention-2 style prefill forward kernel (Triton) returning (O, LSE).

Features
--------
* GQA/MQA without materialising repeated K/V: the program for query head ``h``
  reads KV head ``h // G`` with ``G = Hq // Hkv`` (any integer group size).
* Causal masking by ABSOLUTE positions: query row ``i`` (position ``q_start + i``)
  sees key ``j`` (position ``k_start + j``) iff ``k_start + j <= q_start + i``.
  ``q_start`` / ``k_start`` are python ints or per-sequence int tensors ``[B]``.
  This is what context-parallel / ring attention needs: a KV chunk that lives
  at another offset than the queries is masked correctly, and partial results
  can be merged through the returned LSE.
* Dense ``[B, S, H, D]`` and varlen (``cu_seqlens``) layouts.
* Rows that see no key produce ``O = 0`` and ``LSE = -inf`` exactly (no NaN),
  so they merge as "empty" partial results.
* KV tiles that are fully masked are never visited; KV tiles that are fully
  visible run without any mask arithmetic, only the diagonal band is masked.
* Q/K/V/O tiles move through tensor descriptors (``tl.make_tensor_descriptor``:
  TMA bulk copies on Hopper, zero fill past a sequence's end), so no per-element
  offset tensors live in registers.
* An fp8 (e4m3) KV cache (dense, ``FP8``): its tiles are widened to q's dtype
  and its float32 scales per (key, KV head) applied per key (a chunked prefill
  over the fp8 history; longctx.fp8). Its V may be key-major (``V_KEY_MAJOR``:
  the decode kernel's layout, longctx.fp8.key_major_v): V's descriptor is then
  over V transposed, [D, Sk] with unit stride along keys, its tiles transposed
  after the load.
* head_dim D: any multiple of 8 in [16, 256]. Tiles are BLOCK_D = D padded to a
  power of two wide; the descriptors span D columns, so columns D .. BLOCK_D - 1
  load as 0 (adding 0 to Q K^T) and are dropped from the O store, with no mask
  arithmetic (the accumulating epilogue masks them).
* Online softmax in fp32 using ``exp2`` with ``softmax_scale * log2(e)``
  folded into one multiplier; the returned LSE is the natural-log LSE.

Hopper path
-----------
On sm_90 GPUs `flash_attention_fwd` hands the calls that `hopper_kernel_applies` accepts to a
warp-specialized Gluon kernel (kernels/prefill_hopper.py, imported on first use: a TMA
producer warp and two consumer warpgroups on mbarrier rings, in FA3's order), same contract:
bf16 / fp16, head_dim 64 / 128 / 256 or a multiple of 8 between them (padded to those tiles),
dense or varlen, any lengths and causal offsets, with or without the fused merge, where it
measured faster than the Triton kernel on an H100 (causal from 2048 query rows, unmasked from
512 programs of 128 query rows; the Triton kernel runs two programs per SM, the Gluon kernel
one). Everything else runs the Triton kernel below, and so
does every call with ``LONGCTX_PREFILL_KERNEL=triton`` in the environment at import or inside
``prefill_kernel("triton")`` (A/B runs), under the interpreter, with ``_config``, on other GPUs.

A dense fp8 k/v runs as dequantized blocks where that measured faster (`fp8_blocks_apply`): its
keys dequantized to q's dtype FP8_DEQUANT_KEYS at a time (kernels/fused.py dequantize_fp8,
longctx.fp8.dequantize_kv's values) into one reused buffer each for K and V, each block merged
into a float32 running state by the kernel's accumulating epilogue (`_attend_fp8_blocks`). The
blocks go to the Gluon kernel where its rule applies to q, else (on sm_90, a bf16 / fp16 q, from
16384 keys) to the Triton kernel. The Triton kernel widening e4m3 tiles in registers took 2.7x
the Gluon kernel's time on the same values in bf16 (a chunk of 8192 queries over 262144 keys, 64/8
heads, one H200: 298 against 113 ms; the blocks take 111 ms), and 1.1-4.0x the blocks through
itself (BENCHMARKS.md, fp8 section).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from types import ModuleType

import torch
import triton
import triton.language as tl

from longctx.backend import interpreter_active
from longctx.checks import check_accumulator
from longctx.fp8 import check_key_major, is_key_major
from longctx.kernels.fused import dequantize_fp8
from longctx.kernels.launch import Launch, stream_scratch
from longctx.kernels.merge import _rescale, _state_lse
from longctx.kernels.utils import cdiv, device_capability, next_power_of_2

__all__ = ["flash_attention_fwd", "hopper_kernel_applies", "PrefillPlan", "check_prefill_args"]

_INTERPRET = interpreter_active()
_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------- #
# Triton kernels
# --------------------------------------------------------------------------- #
@triton.jit
def _attn_fwd_step(
    acc, l_i, m_i, q,
    k_desc, v_desc,
    start_n, offs_m, offs_n,
    delta, seqlen_k, qk_scale,
    ks_ptr, vs_ptr, stride_kss, stride_vss,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    V_KEY_MAJOR: tl.constexpr,
):
    """Fold one KV tile (keys ``start_n + offs_n``) into the running softmax state.

    acc:   [BLOCK_M, BLOCK_D] fp32 un-normalised output.
    l_i:   [BLOCK_M] fp32 running softmax denominator.
    m_i:   [BLOCK_M] fp32 running max of ``score * scale * log2(e)`` (-inf = no key seen yet).
    q:     [BLOCK_M, BLOCK_D] query tile (input dtype).
    k_desc / v_desc: tensor descriptors of this sequence's keys / values of one KV head,
        [seqlen_k, HEAD_DIM] with [BLOCK_N, BLOCK_D] blocks; rows and columns outside are
        read as 0 (TMA bulk copies on Hopper).
    offs_m: [BLOCK_M] in-sequence query rows; offs_n: [BLOCK_N] = arange(BLOCK_N).
    delta:  q_start - k_start (only used when CAUSAL).

    MASKED=False: every (row, key) pair of the tile is visible and in bounds,
    so no mask and no -inf guard is needed (the hot path).
    MASKED=True: diagonal band and/or ragged KV tail.
    FP8: K/V tiles are e4m3, widened to q's dtype; key j's float32 scales (ks_ptr / vs_ptr +
    j * stride) multiply its score column and, before P @ V, its probability column.
    V_KEY_MAJOR: v_desc is V transposed, [HEAD_DIM, seqlen_k] with [BLOCK_D, BLOCK_N] blocks
    (a key-major fp8 V, longctx.fp8); its tile is loaded at [0, start_n] and transposed.
    """
    k = k_desc.load([start_n, 0])
    if FP8:
        keys_in = start_n + offs_n < seqlen_k
        k = k.to(q.dtype)
        qk = tl.dot(q, k.T, input_precision=INPUT_PRECISION)
        qk = qk * tl.load(ks_ptr + (start_n + offs_n) * stride_kss, mask=keys_in, other=0.0)[None, :]
    else:
        qk = tl.dot(q, k.T, input_precision=INPUT_PRECISION)

    # ---- online softmax (base 2) ---------------------------------------------
    if MASKED:
        offs_k = start_n + offs_n
        keep = (offs_k < seqlen_k)[None, :]
        if CAUSAL:
            # absolute-position rule: k_start + j <= q_start + i  <=>  j <= i + delta
            keep = keep & (offs_k[None, :] <= (offs_m[:, None] + delta))
        qk = tl.where(keep, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # Rows with no visible key so far keep m = -inf; subtract 0 instead so
        # that exp2(-inf - (-inf)) = NaN never happens (p and alpha become 0).
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
    else:
        # Fully visible tile: every row gets a finite max here.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]

    # ---- O += P V ---------------------------------------------------------------
    if V_KEY_MAJOR:
        v = v_desc.load([0, start_n]).T
    else:
        v = v_desc.load([start_n, 0])
    if FP8:
        v = v.to(q.dtype)
        p = p * tl.load(vs_ptr + (start_n + offs_n) * stride_vss, mask=keys_in, other=0.0)[None, :]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q,
    k_desc, v_desc,
    lo, hi,
    offs_m, offs_n,
    delta, seqlen_k, qk_scale,
    ks_ptr, vs_ptr, stride_kss, stride_vss,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    FP8: tl.constexpr,
    V_KEY_MAJOR: tl.constexpr,
):
    """Consume KV tiles ``[lo, hi)`` (``lo`` a multiple of BLOCK_N); returns (acc, l_i, m_i)."""
    if INTERPRET:
        # The interpreter (numpy >= 2.4) cannot turn tensor-valued range bounds
        # into python ints; a while loop only needs bool(). Never compiled.
        start_n = lo
        while start_n < hi:
            acc, l_i, m_i = _attn_fwd_step(
                acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, offs_n,
                delta, seqlen_k, qk_scale, ks_ptr, vs_ptr, stride_kss, stride_vss,
                MASKED, CAUSAL, INPUT_PRECISION, FP8, V_KEY_MAJOR)
            start_n += BLOCK_N
    else:
        # scf.for with runtime bounds: software-pipelined by num_stages (TMA loads).
        for start_n in tl.range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc, l_i, m_i = _attn_fwd_step(
                acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, offs_n,
                delta, seqlen_k, qk_scale, ks_ptr, vs_ptr, stride_kss, stride_vss,
                MASKED, CAUSAL, INPUT_PRECISION, FP8, V_KEY_MAJOR)
    return acc, l_i, m_i


# Offsets and lengths change from call to call (ring steps, chunked prefill): do not
# specialise on their values (==1, %16) to avoid recompiles; they only feed loop bounds.
@triton.jit(do_not_specialize=["Q_START", "K_START", "seqlen_q_dense", "seqlen_k_dense", "max_seqlen_q"])
def _attn_fwd_kernel(
    Q, K, V, O, LSE,
    Q_START, K_START,          # python ints or int32/int64 pointers [B]
    CU_SEQLENS_Q, CU_SEQLENS_K,  # int32 [B+1] (varlen only; dummy otherwise)
    K_SCALE, V_SCALE,          # FP8: float32 [B, Sk, Hkv] per-key scales (dummies otherwise)
    stride_qb, stride_qs, stride_qh,  # head_dim stride is 1 (tensor descriptors need it)
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_vd,  # stride_vd: 1, or V_KEY_MAJOR's (stride_vs 1)
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    seqlen_q_dense, seqlen_k_dense,
    max_seqlen_q,              # sizes the grid: cdiv(max_seqlen_q, BLOCK_M) query tiles per head
    num_heads_q, group_size,
    qk_scale,                  # softmax_scale * log2(e)
    stride_ksb, stride_kss, stride_ksh,  # FP8: the scales' strides (0 otherwise)
    stride_vsb, stride_vss, stride_vsh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    Q_START_IS_TENSOR: tl.constexpr,
    K_START_IS_TENSOR: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    M_FASTEST: tl.constexpr = False,
    ACCUMULATE: tl.constexpr = False,
    FP8: tl.constexpr = False,  # e4m3 K/V (dense) with float32 scales per (key, KV head)
    V_KEY_MAJOR: tl.constexpr = False,  # FP8's V stored key-major (longctx.fp8)
):
    """One program = one (batch, q head, BLOCK_M query rows) tile.

    ACCUMULATE=False: O (q's dtype) and LSE receive the tile's output and LSE.
    ACCUMULATE=True: O [.., D] float32 and LSE float32 hold a running state (a ring's
    accumulator) and the tile's state is merged into it in place, by the merge layer's rule.

    grid = (B * Hq * cdiv(max_seqlen_q, BLOCK_M),). M_FASTEST=False: consecutive programs
    are the heads of one query tile; True: the query tiles of one head, so the programs
    resident at any time stream the same K/V (L2 reuse when every head has its own K/V).
    Query tiles are walked backwards so that, for causal attention, the most expensive
    (last) tiles are scheduled first (better tail balance).
    """
    pid = tl.program_id(0)
    num_m = tl.cdiv(max_seqlen_q, BLOCK_M)
    if M_FASTEST:
        off_bh = pid // num_m
        start_m = num_m - 1 - pid % num_m
    else:
        num_bh = tl.num_programs(0) // num_m
        off_bh = pid % num_bh
        start_m = num_m - 1 - pid // num_bh
    off_b = off_bh // num_heads_q
    off_h = off_bh % num_heads_q
    off_kvh = off_h // group_size

    if IS_VARLEN:
        q_seq0 = tl.load(CU_SEQLENS_Q + off_b)
        seqlen_q = tl.load(CU_SEQLENS_Q + off_b + 1) - q_seq0
        k_seq0 = tl.load(CU_SEQLENS_K + off_b)
        seqlen_k = tl.load(CU_SEQLENS_K + off_b + 1) - k_seq0
        k_seq0 = k_seq0.to(tl.int64)
    else:
        q_seq0 = 0
        seqlen_q = seqlen_q_dense
        k_seq0 = 0
        seqlen_k = seqlen_k_dense

    m0 = start_m * BLOCK_M
    if m0 >= seqlen_q:
        return  # varlen: this sequence is shorter than max_seqlen_q

    offs_m = m0 + tl.arange(0, BLOCK_M)  # in-sequence row index
    offs_n = tl.arange(0, BLOCK_N)
    row_in = offs_m < seqlen_q

    # ---- 64-bit base offsets (B*S*H*D may exceed 2^31) --------------------
    b64 = off_b.to(tl.int64)
    q_base = (b64 * stride_qb + (q_seq0 + m0).to(tl.int64) * stride_qs
              + off_h.to(tl.int64) * stride_qh)
    o_base = (b64 * stride_ob + (q_seq0 + m0).to(tl.int64) * stride_os
              + off_h.to(tl.int64) * stride_oh)
    k_base = b64 * stride_kb + k_seq0 * stride_ks + off_kvh.to(tl.int64) * stride_kh
    v_base = b64 * stride_vb + k_seq0 * stride_vs + off_kvh.to(tl.int64) * stride_vh

    # Tensor descriptors over this (sequence, head): TMA copies on Hopper, zero fill outside.
    q_desc = tl.make_tensor_descriptor(Q + q_base - m0.to(tl.int64) * stride_qs,
                                       shape=[seqlen_q, HEAD_DIM], strides=[stride_qs, 1],
                                       block_shape=[BLOCK_M, BLOCK_D])
    k_desc = tl.make_tensor_descriptor(K + k_base, shape=[seqlen_k, HEAD_DIM],
                                       strides=[stride_ks, 1], block_shape=[BLOCK_N, BLOCK_D])
    if V_KEY_MAJOR:
        # V transposed, keys contiguous: TMA zero-fills keys past seqlen_k as it does K's rows.
        v_desc = tl.make_tensor_descriptor(V + v_base, shape=[HEAD_DIM, seqlen_k],
                                           strides=[stride_vd, 1], block_shape=[BLOCK_D, BLOCK_N])
    else:
        v_desc = tl.make_tensor_descriptor(V + v_base, shape=[seqlen_k, HEAD_DIM],
                                           strides=[stride_vs, 1], block_shape=[BLOCK_N, BLOCK_D])
    q = q_desc.load([m0, 0])
    ks_ptr = K_SCALE + b64 * stride_ksb + off_kvh.to(tl.int64) * stride_ksh
    vs_ptr = V_SCALE + b64 * stride_vsb + off_kvh.to(tl.int64) * stride_vsh

    # ---- KV loop bounds from absolute positions ---------------------------
    rows_end = tl.minimum(m0 + BLOCK_M, seqlen_q)  # exclusive, real rows only
    if CAUSAL:
        if Q_START_IS_TENSOR:
            q_start = tl.load(Q_START + off_b).to(tl.int64)
        else:
            q_start = Q_START.to(tl.int64)
        if K_START_IS_TENSOR:
            k_start = tl.load(K_START + off_b).to(tl.int64)
        else:
            k_start = K_START.to(tl.int64)
        # Clamping to +-2^30 keeps the visibility pattern (sequences are shorter than
        # 2^30) and lets all bound arithmetic below stay in int32.
        delta = tl.minimum(tl.maximum(q_start - k_start, -(1 << 30)), 1 << 30).to(tl.int32)
        # last visible key of the tile's last real row: j = (rows_end - 1) + delta
        hi = tl.minimum(tl.maximum(rows_end + delta, 0), seqlen_k)
        # keys j <= m0 + delta are visible to every row of the tile
        full = tl.minimum(tl.maximum(m0 + 1 + delta, 0), seqlen_k)
    else:
        delta = 0
        hi = seqlen_k
        full = seqlen_k
    mid = (full // BLOCK_N) * BLOCK_N  # end of the unmasked, tile-aligned prefix

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Stage 1: fully visible, in-bounds tiles -> no masking at all.
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_desc, v_desc, 0, mid, offs_m, offs_n, delta, seqlen_k, qk_scale,
        ks_ptr, vs_ptr, stride_kss, stride_vss, BLOCK_N, False, CAUSAL, INPUT_PRECISION,
        INTERPRET, FP8, V_KEY_MAJOR)
    # Stage 2: diagonal band (+ ragged KV tail).
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_desc, v_desc, mid, hi, offs_m, offs_n, delta, seqlen_k, qk_scale,
        ks_ptr, vs_ptr, stride_kss, stride_vss, BLOCK_N, True, CAUSAL, INPUT_PRECISION,
        INTERPRET, FP8, V_KEY_MAJOR)

    # ---- epilogue: normalise; empty rows -> O = 0, LSE = -inf ---------------
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    acc = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)

    l_base = (b64 * stride_lb + off_h.to(tl.int64) * stride_lh
              + (q_seq0 + m0).to(tl.int64) * stride_ls)
    l_ptrs = LSE + l_base + tl.arange(0, BLOCK_M) * stride_ls
    if ACCUMULATE:
        # merge_into's rule (kernels/merge.py) on this tile: each (row, head) belongs to exactly
        # one program, so there is no race between programs.
        offs_d = tl.arange(0, BLOCK_D)
        tile = row_in[:, None] & (offs_d < HEAD_DIM)[None, :]
        o_ptrs = O + o_base + tl.arange(0, BLOCK_M)[:, None] * stride_os + offs_d[None, :]
        lse_old = tl.load(l_ptrs, mask=row_in, other=float("-inf"))
        m = tl.maximum(lse_old, lse)
        w_old, w_new = _rescale(lse_old, m, lse)
        o_old = tl.load(o_ptrs, mask=tile & (w_old > 0)[:, None], other=0.0)
        s = w_old + w_new
        acc = (o_old * w_old[:, None] + acc * w_new[:, None]) / tl.where(s > 0, s, 1.0)[:, None]
        # Every warp has read the old state before any overwrites it (see _merge_into_kernel).
        tl.debug_barrier()
        tl.store(o_ptrs, acc, mask=tile)
        tl.store(l_ptrs, _state_lse(m, s), mask=row_in)
    else:
        o_desc = tl.make_tensor_descriptor(O + o_base - m0.to(tl.int64) * stride_os,
                                           shape=[seqlen_q, HEAD_DIM], strides=[stride_os, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
        o_desc.store([m0, 0], acc.to(O.dtype.element_ty))  # rows past seqlen_q are dropped
        tl.store(l_ptrs, lse, mask=row_in)


# --------------------------------------------------------------------------- #
# Launch configuration
# --------------------------------------------------------------------------- #
# A fixed table instead of Triton's runtime autotuner: the autotuner keyed shapes by coarse
# length buckets, so the first shape timed chose the config for every other shape of its bucket
# (32/32 heads at 65536 ran a 16/2-at-16384 pick at 407 TFLOPS instead of 502), and in a ring
# it timed its candidates on the first call while NCCL shared the GPU. The table is what
# `python bench/tune_prefill.py` measured on an H100 (bf16, D=128; bench/results/tune-prefill-
# h100*.{txt,json}):
#   * half precision, D <= 128: 128x64 tiles, 8 warps, 2 stages, at most 128 registers per
#     thread, so that two programs (16 warps, 2 x 96 KiB of shared memory) share an SM and one's
#     softmax overlaps the other's tensor-core work. Best of 14 variants at every shape swept
#     (4096-65536 rows, 16/2 and 32/32 heads, causal or not); without the register cap the same
#     tiles run one program per SM and lose 22-34%.
#   * grid order: without a causal mask, the query tiles of one head side by side (M_FASTEST):
#     every program of a head streams the same K/V, which the L2 then serves to all of them;
#     with a mask, only once a KV head's K/V reach _L2_KV_HEAD_BYTES, else the heads of one
#     query tile. Measured with that config, query tiles first vs heads first (tune-prefill-
#     h100-table.txt, -ring-shapes.txt): unmasked 32/32 65536 518 vs 373 TFLOPS, 32768 498 vs
#     414, 16384 522 vs 495, the ring's 16384 x 8192 blocks 536 vs 480, level (+-2%) at 4096;
#     causal 32/32 65536 525 vs 392 (32768: 526 vs 459 in a console run, not kept), while heads
#     first wins below 16 MiB per KV head (16/2 causal: 532 vs 481 at 16384, 467 vs 320 at
#     4096; 32/8 8192: 529 vs 482). Above it the rule is not always right: 16/2 causal 65536
#     (32 MiB) measured 522 query tiles first vs 529 heads first, within run-to-run noise.
#   * at most 64 query rows (chunked-prefill tails, ring steps of few tokens), D <= 128: 64-row
#     tiles, so a 128-row tile does not compute mostly padding (a choice, not a measurement).
# (BLOCK_M, BLOCK_N, num_warps, num_stages, maxnreg or None).
_HALF = (128, 64, 8, 2, 128)
_HALF_SHORT_Q = (64, 64, 4, 3, None)
_D256 = (128, 64, 8, 2, None)
# fp32 ("ieee" dots on FMA units, no tensor cores) is a correctness path: small tiles avoid spills.
_FP32 = (32, 32, 4, 2, None)
_FP32_D256 = (32, 16, 4, 2, None)
# An fp8 K/V (a chunked prefill over an fp8 cache) widens its tiles in registers: _HALF spills
# there (204 bytes at D=128) and _D256 too (92), so half the key block (D <= 128: still two
# programs per SM under the 128-register cap) and a quarter (D > 128). Chosen from offline
# sm_90 compiles without spills, not measured; _HALF_SHORT_Q compiles without spills as it is.
_FP8_HALF = (128, 32, 8, 2, 128)
_FP8_D256 = (128, 16, 8, 2, None)
_L2_KV_HEAD_BYTES = 16 << 20
# Every config the table can choose (the GPU tests run each one).
LAUNCH_CONFIGS = (_HALF, _HALF_SHORT_Q, _D256, _FP32, _FP32_D256, _FP8_HALF, _FP8_D256)


def launch_config(head_dim: int, dtype: torch.dtype, causal: bool, max_seqlen_q: int,
                  max_seqlen_k: int, fp8: bool = False,
                  capability: tuple[int, int] | None = None) -> dict:
    """Kernel meta-parameters for one call (dtype: q's; fp8: K/V are an fp8 cache; capability:
    the GPU's, None for an sm_90 one): BLOCK_M, BLOCK_N, num_warps, num_stages, M_FASTEST and,
    where the table caps registers, maxnreg.

    The register cap is for sm_90 and later only, where it was measured. An sm_80 GPU (A100),
    whose mma.sync keeps the tiles in each warp's registers, spills under it: compiled for sm_80
    (`longctx.kernels.offline`), _HALF's key-block loop at D=128 holds 106-114 local loads and
    stores (730-764 instructions) with the cap and 0-4 (538-542) without, and D=64 spills 52
    bytes with it and none without. Not timed: no A100 was lent."""
    if _INTERPRET:  # one small config: the interpreter is slow and bf16-inexact anyway
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1, M_FASTEST=False)
    if dtype == torch.float32:
        cfg = _FP32 if head_dim <= 128 else _FP32_D256
    else:
        cfg = _D256 if head_dim > 128 else _HALF_SHORT_Q if max_seqlen_q <= 64 else _HALF
        if fp8:
            cfg = {_HALF: _FP8_HALF, _D256: _FP8_D256}.get(cfg, cfg)
    kv_head_bytes = 2 * max_seqlen_k * head_dim * (1 if fp8 else dtype.itemsize)
    return _config_dict(cfg, not causal or kv_head_bytes >= _L2_KV_HEAD_BYTES,
                        capability is None or capability >= (9, 0))


def _config_dict(cfg: tuple, m_fastest: bool, cap_registers: bool = True) -> dict:
    bm, bn, warps, stages, maxnreg = cfg
    out = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, M_FASTEST=m_fastest)
    if maxnreg is not None and cap_registers:
        out["maxnreg"] = maxnreg
    return out


# --------------------------------------------------------------------------- #
# Python entry point
# --------------------------------------------------------------------------- #
def _check_offset_arg(x: int | torch.Tensor, batch: int, device: torch.device, name: str) -> None:
    """A start offset: a python int, or an int32/int64 tensor [B] (or 0-dim: broadcast) on device."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 0 and x.shape != (batch,):
            raise ValueError(f"{name} must have shape [{batch}], got {tuple(x.shape)}")
        if x.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32/int64, got {x.dtype}")
        if x.device != device:
            raise ValueError(f"{name} must be on {device}, got {x.device}")


def _offset_arg(x: int | torch.Tensor, batch: int, device: torch.device, name: str
                ) -> tuple[int | torch.Tensor, bool]:
    """A checked start offset as a kernel takes it: (python int, False) or (contiguous [batch]
    int tensor, True); a 0-dim tensor is broadcast on the device (no host sync)."""
    _check_offset_arg(x, batch, device, name)
    if isinstance(x, torch.Tensor):
        return (x.reshape(1).expand(batch) if x.dim() == 0 else x).contiguous(), True
    return int(x), False


def _alloc_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Triton's global scratch for a launch: the 128-byte TMA descriptors each program makes on
    the device and only it reads, in the launch stream's reusable buffer (no allocation per
    call; `stream_scratch` says why that is safe)."""
    return stream_scratch(size, torch._C._cuda_getDevice(), "tma", stream)


def _set_allocator() -> None:
    triton.set_allocator(_alloc_scratch)


# --------------------------------------------------------------------------- #
# Hopper path (kernels/prefill_hopper.py)
# --------------------------------------------------------------------------- #
# Where the Gluon kernel measured faster than the Triton kernel on an H100 (bf16, D=128, 16/2 and
# 32/32 heads, 1024-8192 rows; bench/results/prefill-short-h100.txt): causal from 2048 query rows
# (16/2 2048: 318 vs 244 TFLOPS; 32/32 1024: 171 vs 190), unmasked from 512 programs of 128 query
# rows (32/32 2048: 594 vs 436; 16/2 2048, 256 programs: 382 vs 444). Applied alike to ragged
# lengths, causal offsets (rows: Sq), varlen batches (rows: the mean sequence, total_q / B;
# programs: Hq * total_q / 128, the fewest that hold every row) and head_dim 64 / 256: not
# measured there yet (bench/prefill_short.py measures them).
_CAUSAL_MIN_SEQLEN_Q = 2048
_MIN_PROGRAMS = 512
# head_dim tiles the dispatch sends to the Gluon kernel (its HEAD_DIMS: 64, 128, 256); 64 and 256
# are expected faster than the Triton kernel, to be confirmed by bench/check_prefill_hopper.py.
# A head_dim between them (40 .. 248, multiples of 8: 80, 96, 192, ...) goes there too: split
# into two power-of-two tiles where it can be (192 = 128 + 64; no padding), else padded to its
# tile as the Triton kernel pads it (kernels/prefill_hopper.py `head_tiles`).
_HOPPER_HEAD_DIMS = (64, 128, 256)
_PREFILL_KERNEL_ENV = "LONGCTX_PREFILL_KERNEL"


def _tma_rows(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, data_ptr: int
              ) -> bool:
    """Whether x [B, S, H, D] is the 2-D TMA tensor [B * S, H * D] with row stride x's seq stride:
    unit head_dim stride, head stride D, rows that do not overlap, batch stride S * seq stride
    (or B == 1), 16-byte aligned base and row stride. (The Hopper kernel's host descriptors.)"""
    b, s, h, d = shape
    sb, ss, sh, sd = strides
    return (sd == 1 and sh == d and ss >= h * d and (b == 1 or sb == s * ss)
            and ss * itemsize % 16 == 0 and data_ptr % 16 == 0)


def _tma_seqs(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int,
              data_ptr: int) -> bool:
    """Whether every (sequence, head) [S, D] slice of x ([B, S, H, D] or varlen [T, H, D]) is a
    2-D TMA tensor: unit head_dim stride, rows that do not overlap, and a 16-byte aligned base
    and row stride for every batch, sequence start and head (a batch of one has no batch
    offset to align). (The Hopper kernel's device-side descriptors.)"""
    *outer, ss, sh, sd = strides
    outer = [x for x, n in zip(outer, shape) if n > 1]
    return (sd == 1 and ss >= shape[-1] and data_ptr % 16 == 0
            and all(x * itemsize % 16 == 0 for x in (*outer, ss, sh)))


def hopper_kernel_applies(
    *,
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
    shapes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]],
    strides: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]],
    data_ptrs: tuple[int, int, int],
    capability: tuple[int, int] | None,
    causal: bool,
    varlen: bool,
    config_given: bool,
    num_seqs: int | None = None,
) -> bool:
    """Whether a `flash_attention_fwd` call runs the Gluon Hopper kernel (kernels/prefill_hopper.py).

    dtypes, shapes, strides, data_ptrs: of q, k, v (dense [B, S, H, D]; varlen [T, H, D]);
    capability: the CUDA device's (None off CUDA); num_seqs: varlen's B (cu_seqlens_q.numel() - 1).
    Pure (no device queries), so that the rule is testable on a CPU. The caller also requires
    CUDA tensors, no Triton interpreter and LONGCTX_PREFILL_KERNEL != "triton".

    True for: capability (9, 0); no ``_config``; bf16 / fp16; head_dim a multiple of 8 whose tile
    (the next power of two) is in _HOPPER_HEAD_DIMS;
    dense or varlen, any lengths (none zero), any causal offsets (ints or [B] tensors), with or
    without the fused merge; q, k, v whose (sequence, head) slices TMA can address
    (`_tma_seqs`: the kernel's device-side descriptors); enough work (measured
    rules, above): causal from 2048 query rows (varlen: total_q / B), without a mask from 512
    programs (B * Hq * cdiv(Sq, 128); varlen Hq * cdiv(total_q, 128)).
    """
    q_shape, k_shape, _ = shapes
    if capability != (9, 0) or config_given:
        return False
    if dtypes[0] not in (torch.bfloat16, torch.float16) or len(set(dtypes)) != 1:
        return False
    if len(q_shape) != (3 if varlen else 4) or 0 in (*q_shape, *k_shape):
        return False
    hq, d = q_shape[-2:]
    if d % 8 or next_power_of_2(d) not in _HOPPER_HEAD_DIMS:
        return False
    itemsize = dtypes[0].itemsize
    # The dispatched kernel makes its descriptors on the device, per (sequence, head).
    if not all(_tma_seqs(sh, st, itemsize, p) for sh, st, p in zip(shapes, strides, data_ptrs)):
        return False
    if varlen:
        if not num_seqs:
            return False
        rows, programs = q_shape[0] / num_seqs, hq * -(-q_shape[0] // 128)
    else:
        rows, programs = q_shape[1], q_shape[0] * hq * -(-q_shape[1] // 128)
    if causal:
        return rows >= _CAUSAL_MIN_SEQLEN_Q
    return programs >= _MIN_PROGRAMS


def _parse_prefill_kernel(value: str | None) -> str:
    """LONGCTX_PREFILL_KERNEL's value: unset, "" or "auto" (the Hopper kernel where it applies)
    or "triton" (always the Triton kernel, e.g. for A/B runs)."""
    value = value or "auto"
    if value not in ("auto", "triton"):
        raise ValueError(f"{_PREFILL_KERNEL_ENV} must be 'auto' or 'triton' (or unset), got {value!r}")
    return value


# Read once, at import (as LONGCTX_FAST_LAUNCH): reading the environment costs ~0.5 µs, a tenth
# of an attention call's Python. `prefill_kernel` switches it at run time.
_prefill_choice = _parse_prefill_kernel(os.environ.get(_PREFILL_KERNEL_ENV))


@contextlib.contextmanager
def prefill_kernel(choice: str) -> Iterator[None]:
    """Inside the block CUDA prefill runs `choice`: "auto" (the Hopper kernel where its rule
    applies) or "triton" (always the Triton kernel; A/B runs), whatever LONGCTX_PREFILL_KERNEL
    said at import."""
    global _prefill_choice
    prev, _prefill_choice = _prefill_choice, _parse_prefill_kernel(choice)
    try:
        yield
    finally:
        _prefill_choice = prev


@functools.lru_cache(maxsize=None)
def _hopper_module() -> ModuleType | None:
    """kernels/prefill_hopper.py, imported on first use only (it needs Gluon, which has no
    interpreter); None where this Triton cannot import it."""
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        return None
    # Not guarded: an error in the module itself must not fall back silently to the Triton kernel.
    from longctx.kernels import prefill_hopper
    return prefill_hopper


def _hopper_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    cu_seqlens_q: torch.Tensor | None, max_seqlen_q: int | None,
                    config_given: bool) -> bool:
    """`hopper_kernel_applies` for the signature of these CUDA tensors, their data pointers
    taken as aligned (callers check the alignment per call)."""
    varlen = cu_seqlens_q is not None
    if varlen and max_seqlen_q is None:  # the Triton path reports it
        return False
    return hopper_kernel_applies(
        dtypes=(q.dtype, k.dtype, v.dtype), shapes=(q.shape, k.shape, v.shape),
        strides=(q.stride(), k.stride(), v.stride()), data_ptrs=(0, 0, 0),
        capability=device_capability(q.device), causal=bool(causal), varlen=varlen,
        config_given=config_given, num_seqs=cu_seqlens_q.numel() - 1 if varlen else None)


# Keys per dequantized block of an fp8 k/v (`_attend_fp8_blocks`): the copy is 2 x keys x Hkv x
# D elements of q's dtype; 32768 and 65536 keys measured alike on the Gluon kernel (115.5 / 115.3
# ms at 262144 keys, bench/results/fp8-prefill-blocks-h200.txt).
FP8_DEQUANT_KEYS = 32768
# Keys from which the dequantized blocks through the Triton kernel measured faster than that
# kernel widening the e4m3 tiles in registers at every row count (one H200, D=64/128/256, 64/8,
# 16/2 and 32/32 heads, 16-8192 rows causal at the end of the keys: 1.1-4.0x;
# bench/results/fp8-prefill-blocks-h200.txt, part 5). Below, the blocks' two extra launches and
# each block's call plan cost about what the widening does (4096 keys: 0.6-2.3x, varying from run
# to run) or more (1024 keys: 0.4-0.7x). sm_90 only, where it was measured: wgmma reads K and V
# from shared memory, so widened tiles go back there; an Ada GPU's mma.sync widens in registers.
_FP8_BLOCKS_MIN_KEYS = 16384


def fp8_blocks_apply(*, q_shape: tuple[int, ...], k_shape: tuple[int, ...],
                     q_strides: tuple[int, ...], dtype: torch.dtype,
                     capability: tuple[int, int] | None, causal: bool, config_given: bool,
                     gluon: bool = True) -> bool:
    """Whether a dense fp8 call (q [B, Sq, Hq, D] in `dtype`, k [B, Sk, Hkv, D] e4m3) runs as
    dequantized blocks (`_attend_fp8_blocks`) rather than the Triton kernel widening the e4m3
    tiles itself. Pure, as `hopper_kernel_applies` (capability: the CUDA device's, None off
    CUDA; the caller also requires no Triton interpreter). gluon: whether the blocks may go to
    the Gluon kernel (False under ``prefill_kernel("triton")`` or where Triton has no Gluon).

    True where `hopper_kernel_applies` to q with contiguous blocks of q's dtype (with gluon), or
    on sm_90 for a bf16 / fp16 q from _FP8_BLOCKS_MIN_KEYS keys (the measured rule above; a
    float32 q was not measured), the blocks then attended by the Triton kernel. Never with
    ``_config`` (which keeps the call on the Triton kernel's own form)."""
    b, sk, hkv, d = k_shape
    blk = (b, min(sk, FP8_DEQUANT_KEYS), hkv, d)
    strides = (blk[1] * hkv * d, hkv * d, d, 1)
    if gluon and hopper_kernel_applies(
            dtypes=(dtype,) * 3, shapes=(q_shape, blk, blk), strides=(q_strides, strides, strides),
            data_ptrs=(0, 0, 0), capability=capability, causal=causal, varlen=False,
            config_given=config_given):
        return True
    return (capability == (9, 0) and not config_given and 0 not in (*q_shape, *k_shape)
            and dtype in (torch.bfloat16, torch.float16) and sk >= _FP8_BLOCKS_MIN_KEYS)


def _attend_fp8_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor,
                       v_scale: torch.Tensor, softmax_scale: float, causal: bool,
                       q_start: int | torch.Tensor, k_start: int | torch.Tensor,
                       accumulate: tuple[torch.Tensor, torch.Tensor] | None
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A dense fp8 call, as `flash_attention_fwd`'s contract says: (O in q's dtype, LSE float32),
    or None with the result merged into `accumulate`. k / v are dequantized to q's dtype
    FP8_DEQUANT_KEYS keys at a time (`dequantize_fp8`, into one reused buffer each), each block
    attended by `flash_attention_fwd` and merged into a float32 running state by its
    accumulating epilogue (the merge layer's rule): `accumulate`'s, or a fresh one (O = 0, LSE =
    -inf, what rows that see no key end with) when there is more than one block."""
    b, sk, hkv, d = k.shape
    n_blocks = cdiv(sk, FP8_DEQUANT_KEYS)
    acc = accumulate
    if acc is None and n_blocks > 1:
        acc = (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
               torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device))
    # Block j's copies are written after block j - 1's attention has read them, in stream order.
    kbuf, vbuf = torch.empty((2, b * min(sk, FP8_DEQUANT_KEYS) * hkv * d), dtype=q.dtype,
                             device=q.device)
    for s0 in range(0, sk, FP8_DEQUANT_KEYS):
        n = min(sk - s0, FP8_DEQUANT_KEYS)
        kb, vb = (buf[:b * n * hkv * d].view(b, n, hkv, d) for buf in (kbuf, vbuf))
        dequantize_fp8(k[:, s0:s0 + n], k_scale[:, s0:s0 + n], kb)
        dequantize_fp8(v[:, s0:s0 + n], v_scale[:, s0:s0 + n], vb)
        out = flash_attention_fwd(q, kb, vb, softmax_scale=softmax_scale, causal=causal,
                                  q_start=q_start, k_start=k_start + s0, accumulate=acc)
    if accumulate is not None:
        return None
    return out if acc is None else (acc[0].to(q.dtype), acc[1])


def flash_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    q_start: int | torch.Tensor,
    k_start: int | torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    accumulate: tuple[torch.Tensor, torch.Tensor] | None = None,
    _config: dict | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Attention forward returning (O, LSE), or merging them into a running state.

    Dense:  q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]
            -> o [B, Sq, Hq, D] (q.dtype), lse [B, Sq, Hq] float32 (natural log).
    Varlen: q [total_q, Hq, D], k/v [total_k, Hkv, D], cu_seqlens_q/k int32 [B+1]
            on q.device, max_seqlen_q/k python ints
            -> o [total_q, Hq, D] (q.dtype), lse [total_q, Hq] float32.

    q_start / k_start: absolute position of query row 0 / key 0 of every
    sequence; python ints or int32/int64 tensors [B] on q.device. With
    ``causal`` row i sees key j iff k_start + j <= q_start + i; otherwise all
    keys are visible (offsets ignored). Rows that see no key get O = 0 and
    LSE = -inf. Hq must be a multiple of Hkv (GQA: head h reads KV head
    h // (Hq // Hkv)). fp16/bf16/fp32 inputs, fp32 accumulation.

    Dense k/v may be an fp8 cache (float8_e4m3fn, q in a wider dtype) with k_scale / v_scale
    float32 [B, Sk, Hkv] (any strides): key j is k[:, j] * k_scale[:, j] (longctx.fp8),
    the tiles widened to q's dtype in the kernel and the scales applied per key. head_dim must
    then be a multiple of 16 (TMA's 16-byte alignment of the fp8 rows). v may then be stored
    key-major (longctx.fp8.key_major_v; `check_key_major`'s layout). On an H100 / H200, past
    the measured rule of `fp8_blocks_apply`, the keys go through the Gluon or the Triton kernel
    as dequantized blocks instead (module docstring).

    accumulate (dense only): (o_acc [B, Sq, Hq, D] float32, lse_acc [B, Sq, Hq] float32), a
    running state as `longctx.merge.merge_into` keeps it; the result is merged into it in
    place and nothing is returned (no partial O is written: a ring step's fused merge).

    ``_config`` (testing and tuning): {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages",
    "M_FASTEST"[, "maxnreg"]} instead of `launch_config`'s choice (always the Triton kernel).

    On sm_90 GPUs the calls `hopper_kernel_applies` accepts run kernels/prefill_hopper.py's
    Gluon kernel instead (same contract); ``LONGCTX_PREFILL_KERNEL=triton`` in the environment
    keeps every call on the Triton kernel.
    """
    # Inputs are validated by longctx.attention (shapes, dtypes, devices, GQA, head_dim, and a
    # unit head_dim stride); only what the kernel itself relies on is asserted here.
    check_prefill_args(q, k, v, q_start, k_start, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                       accumulate, k_scale)
    plan = PrefillPlan(q, k, v, softmax_scale=softmax_scale, causal=causal, q_start=q_start,
                       k_start=k_start, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                       accumulate=accumulate, config=_config, k_scale=k_scale, v_scale=v_scale)
    # Triton's generic launch path; longctx.attention caches the plan and launches directly.
    return plan(q, k, v, q_start, k_start, cu_seqlens_q, cu_seqlens_k, accumulate, None,
                k_scale, v_scale)


def check_prefill_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       q_start: int | torch.Tensor, k_start: int | torch.Tensor,
                       cu_seqlens_q: torch.Tensor | None, max_seqlen_q: int | None,
                       max_seqlen_k: int | None,
                       accumulate: tuple[torch.Tensor, torch.Tensor] | None,
                       k_scale: torch.Tensor | None = None) -> None:
    """What `flash_attention_fwd` itself relies on beyond longctx.attention's checks (a function
    of shapes, strides, dtypes and devices only)."""
    is_varlen = cu_seqlens_q is not None
    key_major = k_scale is not None and is_key_major(v)  # an fp8 V stored keys-contiguous
    if any(t.stride(-1) != 1 for t in (q, k)) or (v.stride(-1) != 1 and not key_major):
        raise ValueError("q, k, v need unit stride in head_dim (the tiles move by TMA; only an "
                         "fp8 v may be key-major)")
    if k_scale is not None:
        if is_varlen or accumulate is not None:
            raise ValueError("k_scale / v_scale (an fp8 k/v) are for dense inputs without "
                             "accumulate")
        if key_major:
            check_key_major(v, "v")
        # A key-major V's descriptor rows run along head_dim (stride_vs is 1).
        v_strides = (v.stride(0), v.stride(2), v.stride(3)) if key_major else v.stride()[:3]
        if q.shape[-1] % 16 or any(x % 16 for x in (*k.stride()[:3], *v_strides)):
            raise ValueError(f"an fp8 k/v needs head_dim a multiple of 16 and strides of 16 bytes "
                             f"(TMA), got head_dim {q.shape[-1]}, k strides {k.stride()}, v "
                             f"strides {v.stride()}")
    if accumulate is not None:
        if is_varlen:
            raise ValueError("accumulate is for dense inputs only")
        check_accumulator(*accumulate, q)  # float32 for every q dtype the kernels take
    if is_varlen and (max_seqlen_q is None or max_seqlen_k is None):
        raise ValueError("varlen needs max_seqlen_q and max_seqlen_k (sizes the grid)")
    batch = cu_seqlens_q.numel() - 1 if is_varlen else q.shape[0]
    _check_offset_arg(q_start, batch, q.device, "q_start")
    _check_offset_arg(k_start, batch, q.device, "k_start")


class PrefillPlan:
    """The launch of `flash_attention_fwd` for one input signature, computed once: the Gluon
    Hopper kernel's (`prefill_hopper.HopperLaunch`) where its dispatch rule applies to the
    signature, and the Triton kernel's.

    Built from the shapes, strides, dtypes and devices of the tensors, the types (int or tensor)
    of q_start / k_start, the flags, scale, max_seqlen_q/k, `config` and `return_lse` (what
    longctx.attention keys its plan cache by); never from data pointers or offset values, which
    are the launches' dynamic arguments. A call takes the Hopper kernel unless a data pointer is
    not 16-byte aligned or the Triton kernel is chosen (`prefill_kernel`; both per call), allocates
    O (and the LSE, unless it is not returned: then on the fast path it goes to the stream's
    scratch) unless merging into `accumulate`, and launches once.
    """

    __slots__ = ("lse_shape", "lse_bytes", "return_lse", "empty",
                 "offset_copy", "cu_copy", "launch", "hopper", "fp8_blocks")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float,
                 causal: bool, q_start: int | torch.Tensor, k_start: int | torch.Tensor,
                 cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
                 max_seqlen_q: int | None, max_seqlen_k: int | None,
                 accumulate: tuple[torch.Tensor, torch.Tensor] | None,
                 config: dict | None, return_lse: bool = True,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        is_varlen = cu_seqlens_q is not None
        self.launch = self.hopper = self.fp8_blocks = None
        self.return_lse = return_lse
        varlen_max_q = max_seqlen_q  # the Hopper kernel's grid (varlen); None when dense
        if is_varlen:
            batch = cu_seqlens_q.numel() - 1
            total_q, hq, d = q.shape
            hkv = k.shape[1]
            # Batch stride 0: sequence starts come from cu_seqlens.
            sq_b, sq_s, sq_h = 0, q.stride(0), q.stride(1)
            sk_b, sk_s, sk_h = 0, k.stride(0), k.stride(1)
            sv_b, sv_s, sv_h, sv_d = 0, v.stride(0), v.stride(1), 1
            self.lse_shape = (total_q, hq)
            so_b, so_s, so_h = 0, hq * d, d
            sl_b, sl_h, sl_s = 0, 1, hq
            seqlen_q_dense, seqlen_k_dense = 0, 0
            self.cu_copy = (not cu_seqlens_q.is_contiguous(), not cu_seqlens_k.is_contiguous())
            cu_dtypes = (cu_seqlens_q.dtype, cu_seqlens_k.dtype)
            sk = None
        else:
            batch, sq, hq, d = q.shape
            sk, hkv = k.shape[1], k.shape[2]
            max_seqlen_q, max_seqlen_k = sq, sk
            sq_b, sq_s, sq_h, _ = q.stride()
            sk_b, sk_s, sk_h, _ = k.stride()
            sv_b, sv_s, sv_h, sv_d = v.stride()
            if accumulate is None:
                self.lse_shape = (batch, sq, hq)
                so_b, so_s, so_h = sq * hq * d, hq * d, d
                sl_b, sl_h, sl_s = sq * hq, 1, hq
            else:
                self.lse_shape = None
                so_b, so_s, so_h, _ = accumulate[0].stride()
                sl_b, sl_s, sl_h = accumulate[1].stride()
            seqlen_q_dense, seqlen_k_dense = sq, sk
            self.cu_copy = (False, False)
            cu_dtypes = (q.dtype, q.dtype)  # dummies (q), never dereferenced (IS_VARLEN=False)
        self.empty = (batch == 0 or q.numel() == 0 or max_seqlen_q == 0
                      or (accumulate is not None and sk == 0))
        # Offsets as tensors: [B] ints on q's device; a 0-dim one is broadcast on the device (no
        # host sync) and any non-contiguous one copied, per call.
        self.offset_copy = tuple(isinstance(x, torch.Tensor) and (x.dim() == 0 or not x.is_contiguous())
                                 for x in (q_start, k_start))
        self.lse_bytes = 4 * (batch * hq * max_seqlen_q if not is_varlen else hq * q.shape[0])
        if self.empty:
            return
        # The Hopper kernel where its dispatch rule applies to this signature (the rule reads
        # data pointers only for their 16-byte alignment, checked per call).
        if (q.is_cuda and not _INTERPRET and _hopper_applies(q, k, v, causal, cu_seqlens_q,
                                                              max_seqlen_q, config is not None)
                and (hopper := _hopper_module()) is not None):
            self.hopper = hopper.HopperLaunch(q, k, v, softmax_scale, causal, accumulate, q_start,
                                              k_start, cu_seqlens_q, cu_seqlens_k, varlen_max_q)
        # An fp8 k/v: dequantized blocks where they measured faster (`fp8_blocks_apply`), for
        # the Triton kernel (kept under prefill_kernel("triton")) or the Gluon kernel (not).
        if k_scale is not None and q.is_cuda and not _INTERPRET:
            rule = functools.partial(
                fp8_blocks_apply, q_shape=tuple(q.shape), k_shape=tuple(k.shape),
                q_strides=q.stride(), dtype=q.dtype, capability=device_capability(q.device),
                causal=bool(causal), config_given=config is not None)
            on_triton = rule(gluon=False)
            if on_triton or rule(gluon=_hopper_module() is not None):
                self.fp8_blocks = (float(softmax_scale), bool(causal), on_triton)
        block_d = max(next_power_of_2(d), 16)
        # fp32: true fp32 FMA dots (~1e-6 error) instead of TF32; ignored for fp16/bf16.
        input_precision = "ieee" if q.dtype == torch.float32 else "tf32"
        cfg = dict(config) if config is not None else launch_config(
            d, q.dtype, bool(causal), max_seqlen_q, max_seqlen_k, fp8=k_scale is not None,
            capability=device_capability(q.device))
        num_warps, num_stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 1)
        qs_t, ks_t = (isinstance(x, torch.Tensor) for x in (q_start, k_start))
        o_dtype = q.dtype if accumulate is None else accumulate[0].dtype
        fp8 = k_scale is not None
        scale_strides = (*k_scale.stride(), *v_scale.stride()) if fp8 else (0,) * 6
        self.launch = Launch(
            _attn_fwd_kernel, (batch * hq * cdiv(max_seqlen_q, cfg["BLOCK_M"]),),
            (q.dtype, k.dtype, v.dtype, o_dtype, torch.float32,
             q_start.dtype if qs_t else None, k_start.dtype if ks_t else None, *cu_dtypes,
             torch.float32, torch.float32),
            (sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, sv_d, so_b, so_s, so_h,
             sl_b, sl_h, sl_s, seqlen_q_dense, seqlen_k_dense, max_seqlen_q,
             hq, hq // hkv, float(softmax_scale) * _LOG2E, *scale_strides),
            dict(HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=bool(causal), IS_VARLEN=is_varlen,
                 Q_START_IS_TENSOR=qs_t, K_START_IS_TENSOR=ks_t, INPUT_PRECISION=input_precision,
                 INTERPRET=_INTERPRET, ACCUMULATE=accumulate is not None, **cfg,
                 num_warps=num_warps, num_stages=num_stages, **({"FP8": True} if fp8 else {}),
                 **({"V_KEY_MAJOR": True} if fp8 and is_key_major(v) else {})))

    def _offset(self, x: int | torch.Tensor, i: int, batch: int) -> int | torch.Tensor:
        """A start offset as the kernel takes it: a python int, or a contiguous [batch] tensor."""
        if not isinstance(x, torch.Tensor):
            return int(x)
        if self.offset_copy[i]:
            x = x.reshape(1).expand(batch) if x.dim() == 0 else x
            return x.contiguous()
        return x

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 q_start: int | torch.Tensor, k_start: int | torch.Tensor,
                 cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
                 accumulate: tuple[torch.Tensor, torch.Tensor] | None, device: int | None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(o, lse), or None when merging into `accumulate`; lse is None when the plan was made
        without return_lse and launched fast (it then goes to the stream's scratch). device: the
        current CUDA device for a fast launch, None for Triton's path. k_scale / v_scale: an
        fp8 k/v's scales (the plan was made with them)."""
        hopper = self.hopper
        if hopper is not None and ((q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15
                                   or _prefill_choice == "triton"):
            hopper = None
        # Blocks chosen for the Gluon kernel only are not taken under prefill_kernel("triton").
        blocks = self.fp8_blocks
        if (blocks is not None and self.launch is not None
                and (blocks[2] or _prefill_choice != "triton")):
            return _attend_fp8_blocks(q, k, v, k_scale, v_scale, *blocks[:2], q_start, k_start,
                                      accumulate)
        if accumulate is None:
            # o is shaped like q in q's dtype: empty_like parses its arguments in half torch.empty's
            # time.
            o = torch.empty_like(q, memory_format=torch.contiguous_format)
            lse = (torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
                   if self.return_lse or device is None else None)
        else:
            o, lse = accumulate
        if self.launch is None:  # nothing to attend: the empty state, or an unchanged accumulator
            if accumulate is not None:
                return None
            if lse is not None:
                lse.fill_(float("-inf"))
            o.zero_()
            return o, lse
        if cu_seqlens_q is None:
            cu_q = cu_k = q  # dummies, never dereferenced (IS_VARLEN=False)
            batch = q.shape[0]
        else:
            cu_q = cu_seqlens_q.contiguous() if self.cu_copy[0] else cu_seqlens_q
            cu_k = cu_seqlens_k.contiguous() if self.cu_copy[1] else cu_seqlens_k
            batch = cu_seqlens_q.shape[0] - 1
        if device is None:
            if hopper is not None:
                hopper.generic(q, k, v, o, lse, q_start, k_start, cu_q, cu_k)
            else:
                qs, ks = self._offset(q_start, 0, batch), self._offset(k_start, 1, batch)
                if q.is_cuda:
                    _set_allocator()  # tensor descriptors made on the device need global scratch
                scales = (k_scale, v_scale) if k_scale is not None else (lse, lse)  # dummies
                self.launch.generic(q, k, v, o, lse, qs, ks, cu_q, cu_k, *scales)
            return None if accumulate is not None else (o, lse)
        # Held until the launch is queued: inside a graph capture stream_scratch allocates, and a
        # buffer dropped earlier could be handed to the launch's own scratch (overlapping it).
        lse_buf = lse if lse is not None else stream_scratch(self.lse_bytes, device, "lse")
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse_buf.data_ptr())
        _set_allocator()  # the launch's descriptor scratch, should it take Triton's path
        if hopper is not None:
            hopper(ptrs, q_start, k_start, cu_q, cu_k, q.device, device)
        else:
            qs, ks = self._offset(q_start, 0, batch), self._offset(k_start, 1, batch)
            scales = ((k_scale.data_ptr(), v_scale.data_ptr()) if k_scale is not None
                      else (ptrs[4], ptrs[4]))  # dummies (the LSE's), never dereferenced
            self.launch(ptrs + (qs if type(qs) is int else qs.data_ptr(),
                                ks if type(ks) is int else ks.data_ptr(),
                                cu_q.data_ptr(), cu_k.data_ptr()) + scales, device)
        return None if accumulate is not None else (o, lse)
