"""Flash-Decoding: split-KV decode attention with GQA packing.

One query token per sequence attends to its KV cache (contiguous or paged, ragged
lengths). The KV range of every sequence is cut into ``num_splits`` chunks; each
Triton program handles one (split, batch, kv-head) triple and *all* query heads of
that GQA group, so every K/V byte is read from HBM exactly once. Each program
writes a partial, normalised output and its log-sum-exp; the merge layer's rule
combines them (as it combines partials from other GPUs / other KV shards), either in
a second launch (kernels/merge.py) or, with few splits, in the split kernel itself:
each program counts itself in (an atomic per group) and the last to arrive merges
its group's partials (`fuse_merge` says when, with the measurements).

An fp8 (e4m3) cache carries a float32 scale per (key, KV head) (longctx.fp8): the
kernel reads half the bytes, widens the tiles to float16 (float32 for a float32 q) and
applies the scales per key (K's to the scores, V's to the probabilities), behind the FP8
constexpr (`_attend_block` says how float16's range is kept).

The split ranges are computed inside the kernel from ``cache_seqlens`` (a device
tensor). The launch grid depends only on ``num_splits``, batch and head counts,
never on the current lengths, so there is no host sync and a CUDA graph captured
once replays correctly as sequences grow.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from longctx.backend import interpreter_active
from longctx.fp8 import is_key_major
from longctx.kernels.launch import Launch, stream_counters, stream_scratch
from longctx.kernels.merge import _merge_parts, merge_states_launch
from longctx.kernels.utils import (cdiv, device_capability, device_name, device_sms, head_tiles,
                                   next_power_of_2, pdl_launch, pdl_wait)

__all__ = ["DecodePlan", "flash_decode", "flash_decode_partials", "choose_num_splits",
           "key_major_rule", "splits_rule"]

_LOG2E = 1.4426950408889634
# Upper bound on query heads handled by one program. Larger GQA groups (e.g. MQA
# with 128 heads) are split over a third grid axis to keep the fp32 accumulator
# in registers; K/V is then re-read once per head block (still <= G/64 times).
_MAX_BLOCK_H = 64
# A head_dim that is not a power of two runs as two power-of-two column tiles where it can
# (`head_tiles`: 96 = 64 + 32), except on an fp8 cache; False pads it to one tile (the A/B of
# bench/decode_head_split.py).
SPLIT_HEADS = True
_INTERPRET = interpreter_active()


@triton.jit
def _widen_e4m3(x, WIDEN: tl.constexpr, dtype: tl.constexpr):
    """V's e4m3 tile widened, exact: WIDEN False, to `dtype` by Triton's conversion (the
    interpreter, a float32 q); True, to float16 by cvt.rn.f16x2.e4m3x2 (sm_89+, as e4m3 itself),
    four bytes per two instructions.

    The inline asm is declared impure so that the compiler keeps it where it stands: the tile is
    widened in the layout it was loaded in and the 16-bit tile is laid out for P @ V (ldmatrix,
    transposed). Pure, the widening moves past the layout change and the transposed fp8 operand
    is gathered byte by byte (measured: 1.6x the instructions of the bf16 cache's loop). K, the
    other dot's operand untransposed, takes Triton's pure conversion instead (`_attend_block`).
    """
    if WIDEN:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _max_pair(a0, b0, a1, b1):
    return tl.maximum(a0, a1), tl.maximum(b0, b1)


@triton.jit
def _attend_block(
    q, m_i, l_i, acc, u_v, n_start, end, k_head, v_head, bt_row, num_pages,
    b64, stride_k0, stride_k1, stride_v0, stride_v1, stride_vd, qk_scale,
    ks_head, vs_head, stride_ks0, stride_ks1, stride_vs0, stride_vs1, q_hi, acc_hi,
    k_lo, k_hi, v_lo, v_hi,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    FP8_WIDEN: tl.constexpr,
    D_HI: tl.constexpr,
    V_KEY_MAJOR: tl.constexpr,
):
    """One online-softmax step over keys [n_start, n_start + BLOCK_N) clipped to `end`.

    q [BLOCK_H, BLOCK_D] (cache dtype); m_i, l_i [BLOCK_H] fp32 (max / sum in exp2 domain); acc
    [BLOCK_H, BLOCK_D] fp32 un-normalised output. n_start is a multiple of BLOCK_N. A split head
    (D_HI > 0, `head_tiles`): q_hi [BLOCK_H, D_HI] and acc_hi are the second tile's columns, a
    second dot into the scores and one more into acc_hi (else both are passed through). The
    tiles' first columns: K's (and q's) k_lo / k_hi, V's (and acc's) v_lo / v_hi
    (`_split_head_tiles`); 0 / BLOCK_D unless a split head's rows start mid-line.

    FP8: K and V are e4m3 with a float32 scale per key (ks_head / vs_head). The tiles are widened
    to q's dtype (K by Triton's conversion, V by `_widen_e4m3`): float32, or float16 for a
    half-precision q (which comes scaled to |q| <= 1, its scale inside qk_scale), the scales going
    on per key: K's on the scores, V's on the probabilities before P @ V. Those products
    p * scale must stay in float16's range whatever the cache's magnitudes, so they are taken
    relative to u_v [BLOCK_H], the largest V scale seen so far (acc holds the output / u_v,
    rescaled with alpha when u_v grows, as for the running maximum): p * scale / u_v <= 1.
    Without it a cache of V values ~1e-4 lost 23% of the output's precision to float16's
    subnormals.

    V_KEY_MAJOR: an fp8 V stored key-major (longctx.fp8: unit stride along keys, stride_vd
    between head_dim columns; paged: within each page), read 16 keys at a time and widened by
    Triton's conversion, which then moves into P @ V's operand as K's does (P @ V reduces over
    keys, V's contiguous axis).
    """
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = n_start + offs_n0
    n_mask = offs_n < end
    # Keys past `end` (only in a split's last block) read key end - 1 instead: every load stays
    # in the sequence, so none needs a mask (a third of the loop's instructions went to the
    # masks' compares and selects), and their scores are set to -inf below. Not zero-filled
    # rows: V's rows are multiplied by p = 0, which must not meet whatever lies past the end.
    rows_n = tl.minimum(offs_n, end - 1)
    if PAGED:
        if BLOCK_N <= PAGE_SIZE:
            # Block is BLOCK_N-aligned and PAGE_SIZE % BLOCK_N == 0, so it lies
            # inside one page: one scalar table lookup per block.
            page = tl.load(bt_row + n_start // PAGE_SIZE).to(tl.int64)
        else:
            # Block spans several pages: per-row gather of page ids.
            page = tl.load(bt_row + rows_n // PAGE_SIZE).to(tl.int64)
        slot = (rows_n % PAGE_SIZE).to(tl.int64)
        # A page id out of range is never dereferenced; its scores become NaN instead, so the
        # sequence's output is NaN: loud, without a host-side check.
        page_ok = (page >= 0) & (page < num_pages)
        page = tl.where(page_ok, page, 0)
        k_rows = page * stride_k0 + slot * stride_k1
        v_rows = page * stride_v0 + slot * stride_v1
        if FP8:
            ks_rows = page * stride_ks0 + slot * stride_ks1
            vs_rows = page * stride_vs0 + slot * stride_vs1
    else:
        pos = rows_n.to(tl.int64)
        k_rows = b64 * stride_k0 + pos * stride_k1
        v_rows = b64 * stride_v0 + pos * stride_v1
        if FP8:
            ks_rows = b64 * stride_ks0 + pos * stride_ks1
            vs_rows = b64 * stride_vs0 + pos * stride_vs1

    if V_KEY_MAJOR:
        # Keys run along V's rows here, so rows_n's clamp (which breaks their contiguity) is
        # replaced by a mask per 16 keys: groups wholly past `end` are not read (zeros), the
        # group holding `end` is read whole, its slots past the end finite by the cache's
        # contract (longctx.fp8) and multiplied by p = 0. n_start is a multiple of BLOCK_N.
        v_keys = tl.max_contiguous(tl.multiple_of(offs_n, 16), 16)
        v_mask = tl.max_constancy((offs_n // 16) * 16 < end, 16)[:, None]
        if HEAD_DIM == BLOCK_D:
            k = tl.load(k_head + k_rows[:, None] + offs_d[None, :])
        else:  # padded head_dim (as below)
            d_ok = (offs_d < HEAD_DIM)[None, :]
            k = tl.load(k_head + k_rows[:, None] + offs_d[None, :], mask=d_ok, other=0.0)
            v_mask = v_mask & d_ok
        if PAGED:
            # Pages of key-major rows (page_size keys each, a multiple of 16): a 16-key group
            # lies in one page, the page of its keys' clamped rows (the group holding `end`
            # shares end - 1's page; groups past it are masked off).
            v_page = page if BLOCK_N <= PAGE_SIZE else tl.max_constancy(page, 16)
            v_slot = tl.max_contiguous(tl.multiple_of(v_keys % PAGE_SIZE, 16), 16)
            v_rows_km = v_page * stride_v0 + v_slot * stride_v1
        else:
            v_rows_km = b64 * stride_v0 + v_keys * stride_v1
        v = tl.load(v_head + v_rows_km[:, None] + offs_d[None, :].to(tl.int64) * stride_vd,
                    mask=v_mask, other=0.0)
    elif HEAD_DIM == BLOCK_D + D_HI:
        k = tl.load(k_head + k_rows[:, None] + (k_lo + offs_d)[None, :])
        v = tl.load(v_head + v_rows[:, None] + (v_lo + offs_d)[None, :])
    else:  # padded head_dim: its columns read as 0 (no bytes moved), so they add 0 to q.k
        d_mask = (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_head + k_rows[:, None] + offs_d[None, :], mask=d_mask, other=0.0)
        v = tl.load(v_head + v_rows[:, None] + offs_d[None, :], mask=d_mask, other=0.0)

    if FP8:
        # K by Triton's own conversion (cvt.rn.f16x2.e4m3x2 on sm_89+), which the compiler moves
        # past the layout change: K's fp8 tile goes from shared memory straight into the dot's
        # operand registers (8-byte loads), where the impure cvt wrote a float16 copy back to
        # shared memory for ldmatrix. A third fewer shared-memory wavefronts, 12% faster at 32/4
        # heads 1 x 262144 on an H100 (BENCHMARKS.md, fp8 section). V's must stay impure.
        k = k.to(q.dtype)
        v = v.to(q.dtype) if V_KEY_MAJOR else _widen_e4m3(v, FP8_WIDEN, q.dtype)
        k_sc = tl.load(ks_head + ks_rows)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * (k_sc * qk_scale)[None, :]
    elif D_HI > 0:
        offs_dh = tl.arange(0, D_HI)
        k_hi_tile = tl.load(k_head + k_rows[:, None] + (k_hi + offs_dh)[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        s = tl.dot(q_hi, tl.trans(k_hi_tile), s, input_precision=INPUT_PRECISION) * qk_scale
    else:
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
    s = tl.where(n_mask[None, :], s, float("-inf"))
    if PAGED:
        s = tl.where(page_ok, s, float("nan"))

    if FP8:
        # The largest V scale of the block, in the same reduction as the row maxima (a second
        # reduction across the warps cost 20% at 1 x 262144).
        v_sc = tl.load(vs_head + vs_rows)
        s_max, v_max = tl.reduce((s, tl.broadcast_to(v_sc[None, :], s.shape)), 1, _max_pair)
        m_new = tl.maximum(m_i, s_max)
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Guard: a row with no finite score would give (-inf) - (-inf) = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if FP8:
        u_new = tl.maximum(u_v, v_max)  # [BLOCK_H], every entry the same
        inv_u = tl.where(u_new == 0.0, 1.0, 1.0 / u_new)  # all V rows zero so far: p * 0
        p = p * v_sc[None, :] * inv_u[:, None]
        alpha = alpha * (u_v * inv_u)
        u_v = u_new
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    if D_HI > 0:
        v_hi_tile = tl.load(v_head + v_rows[:, None] + (v_hi + offs_dh)[None, :])
        acc_hi = acc_hi * alpha[:, None] + tl.dot(p.to(v.dtype), v_hi_tile,
                                                  input_precision=INPUT_PRECISION)
    return m_new, l_i, acc, u_v, acc_hi


@triton.jit
def _split_head_tiles(head, BLOCK_D: tl.constexpr, D_HI: tl.constexpr,
                      ALIGN_TILES: tl.constexpr):
    """The first columns (lo, hi) of a split head's two tiles (BLOCK_D and D_HI wide) in the
    cache whose rows of this head start at `head`: 0 / BLOCK_D, or with ALIGN_TILES (every row
    of the head starts at the same offset in a 128-byte line) D_HI / 0 where that order puts the
    wide tile on whole lines. At 96 = 64 + 32 columns of 16 bits and two KV heads a token, head
    1's rows start 64 bytes into a line, and its 64-column tile took two lines a row; taking its
    32 columns first made D=96 1.02-1.11x faster on an H200, 1.00-1.03x on an H100
    (BENCHMARKS.md, "Tiles in line order")."""
    if ALIGN_TILES:
        into_line = head.to(tl.int64) % 128  # bytes
        tail = D_HI * (head.dtype.element_ty.primitive_bitwidth // 8)
        swap = (into_line != 0) & ((into_line + tail) % 128 == 0)
        lo = tl.multiple_of(tl.where(swap, D_HI, 0), D_HI)
        hi = tl.multiple_of(tl.where(swap, 0, BLOCK_D), D_HI)
    else:
        lo = 0
        hi = BLOCK_D
    return lo, hi


@triton.jit
def _times_8(a, b, c):
    """Three multiples of 8, as expressions whose divisibility by 8 the compiler sees."""
    return (a // 8) * 8, (b // 8) * 8, (c // 8) * 8


@triton.jit
def _decode_split_kernel(
    Q, K, V, SEQLENS, BLOCK_TABLE, O_PART, LSE_PART,
    O, LSE, ARRIVED,  # FUSED_MERGE: merged outputs, arrival counters (else unused)
    K_SCALE, V_SCALE,  # FP8: float32 [dim0, dim1, Hkv] per-key scales (else unused)
    K_MEAN, V_MEAN,  # HAS_MEAN: float32 [B, Hkv, HEAD_DIM] contiguous smoothing means (else unused)
    qk_scale,  # softmax_scale * log2(e): scores live in the exp2 domain
    num_splits,
    capacity,  # keys the cache can hold per sequence: a longer cache_seqlens entry is invalid
    num_pages,
    stride_qb, stride_qh,
    stride_k0, stride_k1, stride_kh,  # dim0 = batch (contiguous) or page (paged)
    stride_v0, stride_v1, stride_vh, stride_vd,  # stride_vd: V's head_dim stride (1 unless key-major)
    stride_sl,
    stride_btb,
    stride_os, stride_ob, stride_oh,
    stride_ls, stride_lb,
    stride_out_b, stride_out_h, stride_lse_b,
    stride_ks0, stride_ks1, stride_ks2, stride_vs0, stride_vs1, stride_vs2,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM's tile: the next power of two (padding columns masked)
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRET_LOOP: tl.constexpr,
    USE_PDL: tl.constexpr,
    HAS_SEQLENS: tl.constexpr = True,  # False: every sequence is full (length = capacity)
    FUSED_MERGE: tl.constexpr = False,  # the last split of each group merges (module docstring)
    MERGE_H: tl.constexpr = 1,  # FUSED_MERGE: query-head rows merged at once (power of two)
    MERGE_P: tl.constexpr = 1,  # FUSED_MERGE: splits loaded at once
    KV_STRIDES_8: tl.constexpr = False,  # K/V strides are multiples of 8 (only told if D % 16)
    ALIGN_TILES: tl.constexpr = False,  # D_HI: order the tiles by line offset (`_split_head_tiles`)
    FP8: tl.constexpr = False,  # e4m3 K/V with float32 scales per (key, KV head)
    FP8_WIDEN: tl.constexpr = False,  # FP8: V's tiles widened by cvt (`_widen_e4m3`)
    D_HI: tl.constexpr = 0,  # a split head's second tile (`head_tiles`): BLOCK_D + D_HI = HEAD_DIM
    V_KEY_MAJOR: tl.constexpr = False,  # FP8: V stored key-major (`_attend_block`, longctx.fp8)
    HAS_MEAN: tl.constexpr = False,  # FP8: the cache holds K - K_MEAN, V - V_MEAN (longctx.fp8)
):
    tl.static_assert(not (FP8 and D_HI > 0))  # an fp8 cache widens and scales whole tiles
    tl.static_assert(not V_KEY_MAJOR or FP8)
    tl.static_assert(not HAS_MEAN or FP8)
    pdl_wait(USE_PDL)  # q and the newest K/V come from the kernels before
    split = tl.program_id(0)
    bh = tl.program_id(1)
    hblk = tl.program_id(2)
    b = bh // HKV
    hkv = bh % HKV
    b64 = b.to(tl.int64)

    offs_h = hblk * BLOCK_H + tl.arange(0, BLOCK_H)  # index within the GQA group
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    if HEAD_DIM == BLOCK_D + D_HI:
        hd_mask = h_mask[:, None]
    else:
        hd_mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_head = hkv * GROUP + offs_h  # global query-head index

    # ---- split range from the current length (device-side, graph-safe) ----
    if HAS_SEQLENS:
        seqlen = tl.load(SEQLENS + b64 * stride_sl)
    else:  # no lengths tensor to allocate per call for the default
        seqlen = tl.zeros((), tl.int32) + capacity
    # An invalid length reads nothing and yields NaN below (no host sync to raise instead).
    len_ok = (seqlen >= 0) & (seqlen <= capacity)
    seqlen = tl.where(len_ok, seqlen, 0)
    per_split = tl.cdiv(seqlen, num_splits)
    chunk = tl.cdiv(per_split, BLOCK_N) * BLOCK_N  # BLOCK_N-aligned chunks
    start = split * chunk
    end = tl.minimum(start + chunk, seqlen)

    if KV_STRIDES_8:
        # Triton knows an int argument's divisibility only by 16: a head_dim such as 40 or 72
        # leaves the K/V rows' 16-byte alignment unknown, and its loads scalar, unless shown.
        stride_k0, stride_k1, stride_kh = _times_8(stride_k0, stride_k1, stride_kh)
        stride_v0, stride_v1, stride_vh = _times_8(stride_v0, stride_v1, stride_vh)
    k_head = K + hkv.to(tl.int64) * stride_kh
    v_head = V + hkv.to(tl.int64) * stride_vh
    k_lo, k_hi = _split_head_tiles(k_head, BLOCK_D, D_HI, ALIGN_TILES)  # q's columns follow K's
    v_lo, v_hi = _split_head_tiles(v_head, BLOCK_D, D_HI, ALIGN_TILES)  # acc's follow V's

    # ---- q tile [BLOCK_H, D]; padded rows are zero and never stored ----
    q_ptrs = (Q + b64 * stride_qb + q_head[:, None].to(tl.int64) * stride_qh
              + (k_lo + offs_d)[None, :])
    if HAS_MEAN:
        # Smoothing: every score over K = cache + K_MEAN gains softmax_scale q.K_MEAN, the same
        # for all keys, so only the LSE moves; the weights sum to 1, so the output gains V_MEAN
        # (both added to the state below). Each split's state is then exact and merges
        # unchanged. Both means are loaded with q, V's held to the end: no load of its own.
        mean_ptrs = (b64 * HKV + hkv) * HEAD_DIM + offs_d
        d_mask = offs_d < HEAD_DIM
        k_mean = tl.load(K_MEAN + mean_ptrs, mask=d_mask, other=0.0)
        v_mean = tl.load(V_MEAN + mean_ptrs, mask=d_mask, other=0.0)
        sm_scale = qk_scale * 0.6931471805599453  # qk_scale * ln(2): scores' natural-log units
    if FP8 and Q.dtype.element_ty == tl.float32:
        q = tl.load(q_ptrs, mask=hd_mask, other=0.0)  # fp32 dots on the widened tiles
        if HAS_MEAN:
            lse_shift = tl.sum(q * k_mean[None, :], axis=1) * sm_scale
    elif FP8:
        # Half precision: the dots run in float16 (cheap to widen e4m3 to, `_widen_e4m3`), q
        # scaled into [-1, 1] by a power of two (exact: float16's range for any q, and bf16's
        # 8 significant bits fit its 11), the scale going onto the scores.
        q = tl.load(q_ptrs, mask=hd_mask, other=0.0).to(tl.float32)
        if HAS_MEAN:
            lse_shift = tl.sum(q * k_mean[None, :], axis=1) * sm_scale
        q_max = tl.maximum(tl.max(tl.max(tl.abs(q), axis=1), axis=0), 1e-30)
        q_pow2 = ((1.0 / q_max).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32,
                                                                             bitcast=True)
        q = (q * q_pow2).to(tl.float16)
        qk_scale = qk_scale / q_pow2
    else:
        q = tl.load(q_ptrs, mask=hd_mask, other=0.0).to(K.dtype.element_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    q_hi, acc_hi = q, acc  # no second tile: passed through the blocks untouched
    if D_HI > 0:
        q_hi = tl.load(Q + b64 * stride_qb + q_head[:, None].to(tl.int64) * stride_qh
                       + (k_hi + tl.arange(0, D_HI))[None, :], mask=h_mask[:, None],
                       other=0.0).to(K.dtype.element_ty)
        acc_hi = tl.zeros([BLOCK_H, D_HI], dtype=tl.float32)
    u_v = tl.zeros([BLOCK_H], tl.float32)  # FP8: acc's unit, the largest V scale so far

    bt_row = BLOCK_TABLE + b64 * stride_btb
    ks_head = K_SCALE + hkv.to(tl.int64) * stride_ks2
    vs_head = V_SCALE + hkv.to(tl.int64) * stride_vs2

    # Empty split (start >= end): loop runs zero times -> empty state below.
    if INTERPRET_LOOP:
        # Triton's CPU interpreter (with numpy >= 2.4) cannot use tensor bounds in
        # range(); a while loop is equivalent there. GPU builds take the for-loop,
        # which the compiler can software-pipeline (num_stages).
        n_start = start
        while n_start < end:
            m_i, l_i, acc, u_v, acc_hi = _attend_block(
                q, m_i, l_i, acc, u_v, n_start, end, k_head, v_head, bt_row, num_pages,
                b64, stride_k0, stride_k1, stride_v0, stride_v1, stride_vd, qk_scale,
                ks_head, vs_head, stride_ks0, stride_ks1, stride_vs0, stride_vs1, q_hi, acc_hi,
                k_lo, k_hi, v_lo, v_hi, HEAD_DIM, BLOCK_D, BLOCK_N, PAGED, PAGE_SIZE,
                INPUT_PRECISION, FP8, FP8_WIDEN, D_HI, V_KEY_MAJOR)
            n_start += BLOCK_N
    else:
        for it in range(start, end, BLOCK_N):
            m_i, l_i, acc, u_v, acc_hi = _attend_block(
                q, m_i, l_i, acc, u_v, tl.multiple_of(it, BLOCK_N), end, k_head, v_head, bt_row,
                num_pages,
                b64, stride_k0, stride_k1, stride_v0, stride_v1, stride_vd, qk_scale,
                ks_head, vs_head, stride_ks0, stride_ks1, stride_vs0, stride_vs1, q_hi, acc_hi,
                k_lo, k_hi, v_lo, v_hi, HEAD_DIM, BLOCK_D, BLOCK_N, PAGED, PAGE_SIZE,
                INPUT_PRECISION, FP8, FP8_WIDEN, D_HI, V_KEY_MAJOR)

    # ---- normalised partial output + natural-log LSE ----
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if FP8:  # acc is in units of u_v
        o = acc * (u_v * (1.0 / l_safe))[:, None]
    else:
        o = acc / l_safe[:, None]  # acc == 0 for empty rows -> exactly 0
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)  # * ln(2)
    if HAS_MEAN:  # an empty state stays o = 0, lse = -inf
        o = tl.where(empty[:, None], o, o + v_mean[None, :])
        lse += lse_shift
    o = tl.where(len_ok, o, float("nan"))
    lse = tl.where(len_ok, lse, float("nan"))

    split64 = split.to(tl.int64)
    o_ptrs = (O_PART + split64 * stride_os + b64 * stride_ob
              + q_head[:, None].to(tl.int64) * stride_oh + (v_lo + offs_d)[None, :])
    tl.store(o_ptrs, o.to(O_PART.dtype.element_ty), mask=hd_mask)
    if D_HI > 0:
        o_hi = tl.where(len_ok, acc_hi / l_safe[:, None], float("nan"))
        o_hi_ptrs = (O_PART + split64 * stride_os + b64 * stride_ob + q_head[:, None].to(tl.int64)
                     * stride_oh + (v_hi + tl.arange(0, D_HI))[None, :])
        tl.store(o_hi_ptrs, o_hi.to(O_PART.dtype.element_ty), mask=h_mask[:, None])
    lse_ptrs = LSE_PART + split64 * stride_ls + b64 * stride_lb + q_head
    tl.store(lse_ptrs, lse, mask=h_mask)

    if FUSED_MERGE:
        # Count this split in; the program that arrives last merges its group's splits (the
        # merge layer's rule) while the others have exited. The barrier orders every warp's
        # stores before the count (one thread's atomic), whose release (GPU scope) publishes
        # them; its acquire, passed on to the program's other warps by the second barrier,
        # orders the other splits' stores before the reads (the pattern of CUTLASS's
        # split-K semaphore).
        tl.debug_barrier()
        counter = ARRIVED + bh * tl.num_programs(2) + hblk
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.debug_barrier()
            tl.store(counter, 0)  # zero again for the next launch (stream order)
            rows = tl.arange(0, MERGE_H)
            head0 = hkv * GROUP + hblk * BLOCK_H  # the program's first query head
            r_mask = hblk * BLOCK_H + rows < GROUP
            heads = head0 + rows
            o_m, lse_m = _merge_parts(
                O_PART + b64 * stride_ob + head0.to(tl.int64) * stride_oh,
                LSE_PART + b64 * stride_lb + head0, num_splits, stride_os, stride_oh, stride_ls,
                rows, r_mask, offs_d, offs_d < HEAD_DIM, MERGE_P)
            o_m = tl.where(len_ok, o_m, float("nan"))  # as each split's (an invalid length)
            lse_m = tl.where(len_ok, lse_m, float("nan"))
            out_ptrs = (O + b64 * stride_out_b + heads[:, None].to(tl.int64) * stride_out_h
                      + offs_d[None, :])
            if HEAD_DIM == BLOCK_D + D_HI:
                out_mask = r_mask[:, None]
            else:
                out_mask = r_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
            tl.store(out_ptrs, o_m.to(O.dtype.element_ty), mask=out_mask)
            tl.store(LSE + b64 * stride_lse_b + heads, lse_m, mask=r_mask)
            if D_HI > 0:  # columns BLOCK_D .., merged with the same weights
                offs_dh = BLOCK_D + tl.arange(0, D_HI)
                o_m, _ = _merge_parts(
                    O_PART + b64 * stride_ob + head0.to(tl.int64) * stride_oh,
                    LSE_PART + b64 * stride_lb + head0, num_splits, stride_os, stride_oh,
                    stride_ls, rows, r_mask, offs_dh, offs_dh < HEAD_DIM, MERGE_P)
                o_m = tl.where(len_ok, o_m, float("nan"))
                out_ptrs = (O + b64 * stride_out_b + heads[:, None].to(tl.int64) * stride_out_h
                            + offs_dh[None, :])
                tl.store(out_ptrs, o_m.to(O.dtype.element_ty), mask=r_mask[:, None])


def _launch_config(head_dim: int, dtype: torch.dtype, block_h: int, keys_per_split: int,
                   device: torch.device, fp8: bool = False, programs: int = 0,
                   key_major: bool = False, page_size: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for the dots' dtype / head_dim / BLOCK_H / split length;
    fp8: an fp8 cache (dtype is then what its tiles are widened to), launched on `programs`
    programs; key_major: its V stored key-major (longctx.fp8); page_size: a paged cache's.

    Half precision, head_dim <= 128, measured with bench/tune_decode.py (16/2 heads, fp16,
    graph replay; bench/results/tune-decode-*.txt): shorter splits prefer BLOCK_N 64 (2 stages
    at <= 256 keys). From 1024 keys per split the best block length depends on the GPU: on an
    H200, 128 keys with 3 stages (64 loses 0.9-1.4 µs at the heuristic's split counts for 67
    MB of cache, 2-5 µs for 134-268 MB); on an H100 80GB HBM3, 64 keys with 3 stages (128 loses
    0.3-1.2 µs). Every GPU named H100 gets the H100's choice, every other one the H200's.
    Other cases were chosen from offline sm_90 compiles (no spills): fp32 ("ieee" dot on FMA
    units) needs small key blocks and 8 warps. A head_dim that is not a power of two takes the
    choice of its tile (the next power of two), split in two or padded (`head_tiles`): swept
    with the split at 96 and 192 on an H100 (bench/results/tune-decode-d{96,192}-split-h100.txt)
    no other config was more than 2% faster.
    """
    d = next_power_of_2(head_dim)
    if fp8 and dtype == torch.float16 and d == 128 and block_h * d < 64 * 128:
        # An fp8 cache (V's tiles widened to float16 in shared memory), swept on an H100
        # (bench/results/fp8-decode-sweep-h100.txt, fp8-decode-warps-h100.txt): with more than
        # two programs per SM (FP8_SPLITS aims at four), 64-key blocks, 2 warps and 2 stages,
        # 3-6% faster than two programs of 128 keys and 4 warps at about the same instructions
        # per key (why was not measured; 1 warp or 32-key blocks are slower); with two per SM
        # (splits held at 1024 keys) 128 keys, 4 warps, 2 stages (2-warp programs lose 16% there);
        # one per SM 128 keys, 4 warps, 3 stages (2 stages lose 20-22%). Re-swept with K's
        # conversion moved into the dot's operand (fp8-decode-k-layout-h100.txt): same picks.
        # On an H200 (fp8-decode-h200.txt) the four programs take 3 stages (56 KB each): 9-11%
        # faster at 1 x 262144 and 1 x 1048576; on an H100 within 2% either way (a tie).
        if key_major and _pages_hold_blocks(page_size):
            # V key-major (no float16 copy of either tile, 63 KB a program at 3 stages): two
            # programs a SM of 128 keys, 4 warps, 3 stages were the best launch at every long
            # shape on an H100 and an H200 (fp8-decode-h200.txt, the probe; KEY_MAJOR_SPLITS).
            return 128, 4, 3
        sms = device_sms(device)
        if programs > 2 * sms:
            return 64, 2, (2 if "H100" in device_name(device) else 3)
        # (in smaller pages a key-major V takes 3 stages here too: 32/4 heads 8 x 8192 at pages
        # of 16 on an H200, 36.5 µs against 41.6 with 2; bench/results/fp8-paged-h200.txt)
        return (128, 4, 2) if programs > sms and not key_major else (128, 4, 3)
    if dtype == torch.float32:
        return (32 if d <= 128 and block_h * d < 64 * 128 else 16), 8, 2
    if d == 256:
        # Tile 256 (head_dim 129-256), bench/tune_decode.py --d 192 / --d 256 on an H200 (16/2
        # heads): 64 keys, 4 warps, 3 stages took 32-35 µs (192) and 40 µs (256) at 64 x 1024,
        # 8 x 8192 and 1 x 65536, 105 / 130 µs at 1 x 262144, against 64-69 / 65-69 and 221 /
        # 223 µs with the earlier 32-key blocks, 2 stages. Programs of 32+ query heads keep
        # those (8 warps; not measured with 64 keys).
        return (64, 4, 3) if block_h * d < 64 * 128 else (32, 8, 2)
    num_warps = 8 if block_h * d >= 64 * 128 else 4
    split_tile = head_tiles(head_dim, SPLIT_HEADS)[1] > 0
    if keys_per_split >= 1024 and split_tile and programs > device_sms(device):
        # A head in two tiles, two programs per SM (`splits_rule`): 64-key blocks (H200, D=96
        # 1 x 262144 at 128 splits: the sweep's best).
        return 64, num_warps, 3
    if keys_per_split >= 1024:
        return (64 if "H100" in device_name(device) else 128), num_warps, 3
    return 64, num_warps, 2 if keys_per_split <= 256 else 3


def _block_h(group: int) -> int:
    """Query heads per split-kernel program: the GQA group padded to a power of two, at least 16
    (tl.dot's minimum M), at most _MAX_BLOCK_H (larger groups take several programs)."""
    return min(max(16, next_power_of_2(group)), _MAX_BLOCK_H)


def _split_launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cache_seqlens: torch.Tensor | None, block_table: torch.Tensor | None,
                  softmax_scale: float, num_splits: int, out_dtype: torch.dtype,
                  config: tuple[int, int, int] | None = None, fused_merge: bool = False,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  means: bool = False) -> Launch:
    """The split kernel's launch for these inputs (read for shapes, strides, dtypes and device
    only), writing contiguous o_part [num_splits, B, Hq, D] out_dtype and lse_part
    [num_splits, B, Hq] float32; with fused_merge (out_dtype float32) also their merge, o
    [B, Hq, D] in q's dtype and lse [B, Hq] float32 (contiguous), counting arrivals in
    `fused_counters(...)` int32 zeros. Dynamic arguments: the pointers of q, k_cache, v_cache,
    cache_seqlens (q's without one), block_table (cache_seqlens' without one), o_part, lse_part,
    o, lse, counters (without fused_merge any pointers: unused), k_scale, v_scale (an fp8 cache's
    float32 [dim0, dim1, Hkv] scales; else any pointers: unused), k_mean, v_mean (with means:
    a smoothed fp8 cache's contiguous [B, Hkv, D] float32 means; else any pointers: unused).
    q: [B, Hq, D] or [B, 1, Hq, D]."""
    B, Hq, D = q.shape[0], q.shape[-2], q.shape[-1]
    Hkv = k_cache.shape[2]
    paged = block_table is not None
    if paged:
        page_size, num_pages = k_cache.shape[1], k_cache.shape[0]
        capacity = block_table.shape[1] * page_size
        stride_btb = block_table.stride(0)
    else:
        page_size, num_pages, capacity = 1, 0, k_cache.shape[1]
        stride_btb = 0  # a dummy pointer, never dereferenced
    sl_dtype = q.dtype if cache_seqlens is None else cache_seqlens.dtype
    group = Hq // Hkv
    block_h = _block_h(group)
    keys = cdiv(capacity, num_splits)
    fp8 = k_scale is not None
    key_major = fp8 and is_key_major(v_cache)
    # The dtype the dots run in: the cache's; for an fp8 cache float32 with a float32 q, else
    # float16 (the kernel's `_widen_e4m3`).
    compute = (k_cache.dtype if not fp8
               else torch.float32 if q.dtype == torch.float32 else torch.float16)
    # an fp8 cache keeps one padded tile (its path widens and scales whole tiles)
    block_d, d_hi = head_tiles(D, SPLIT_HEADS and not fp8)
    # cvt.rn.f16x2.e4m3x2 needs sm_89+ (so does Triton's own e4m3); the interpreter converts itself.
    widen = (fp8 and not _INTERPRET and compute == torch.float16
             and (device_capability(q.device) or (0, 0)) >= (8, 9))
    programs = num_splits * B * Hkv * cdiv(group, block_h)
    block_n, num_warps, num_stages = config or _launch_config(
        D, compute, block_h, keys, q.device, fp8, programs, key_major, page_size if paged else None)
    # fp32: exact fp32 products (tf32 would cost ~1e-3 relative error).
    precision = "ieee" if compute == torch.float32 else "tf32"
    sks = k_scale.stride() if fp8 else (0, 0, 0)
    svs = v_scale.stride() if fp8 else (0, 0, 0)
    sk, sv = k_cache.stride(), v_cache.stride()
    # (a multiple of 16 is specialised by Triton anyway: a power-of-two D compiles unchanged)
    kv_strides_8 = D % 16 != 0 and all(x % 8 == 0 for x in (*sk[:3], *sv[:3]))
    # A split head's tiles may follow its rows' offset in a line when every row of a head has
    # the same one: row strides whole 128-byte lines.
    align_tiles = d_hi > 0 and all(x * k_cache.element_size() % 128 == 0
                                   for x in (*sk[:2], *sv[:2]))
    # Fused merge: the last program of a group merges MERGE_H query heads (its own, padded to a
    # power of two) over MERGE_P splits per load, 64 float32 registers per thread of tile.
    # Unfused launches keep the defaults: one binary whatever the split count.
    merge = {}
    if fused_merge:
        merge_h = min(block_h, next_power_of_2(group))
        merge_p = max(1, min(next_power_of_2(num_splits),
                             64 * 32 * num_warps // (merge_h * block_d)))
        merge = dict(FUSED_MERGE=True, MERGE_H=merge_h, MERGE_P=merge_p)
    return Launch(
        _decode_split_kernel, (num_splits, B * Hkv, cdiv(group, block_h)),
        (q.dtype, k_cache.dtype, v_cache.dtype, sl_dtype,
         sl_dtype if block_table is None else block_table.dtype, out_dtype, torch.float32,
         q.dtype if fused_merge else out_dtype, torch.float32, torch.int32,
         torch.float32, torch.float32, torch.float32, torch.float32),
        (float(softmax_scale) * _LOG2E, num_splits, capacity, num_pages,
         q.stride(0), q.stride(-2), *sk[:3], *sv[:3], sv[3],
         0 if cache_seqlens is None else cache_seqlens.stride(0), stride_btb,
         B * Hq * D, Hq * D, D,  # o_part, contiguous
         B * Hq, Hq,  # lse_part, contiguous
         Hq * D, D, Hq,  # o and lse (fused merge), contiguous
         *sks, *svs),
        dict(HKV=Hkv, GROUP=group, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_N=block_n,
             PAGED=paged, PAGE_SIZE=page_size, INPUT_PRECISION=precision,
             INTERPRET_LOOP=_INTERPRET,
             HAS_SEQLENS=cache_seqlens is not None, **merge, KV_STRIDES_8=kv_strides_8,
             ALIGN_TILES=align_tiles, FP8=fp8,
             FP8_WIDEN=widen, D_HI=d_hi, V_KEY_MAJOR=key_major,
             **({"HAS_MEAN": True} if means else {}), num_warps=num_warps,
             num_stages=num_stages, **pdl_launch(q.device)))


def fused_counters(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Arrival counters a fused-merge split launch needs: one per (batch, KV head, head block)."""
    group = q.shape[-2] // k_cache.shape[2]
    return q.shape[0] * k_cache.shape[2] * cdiv(group, _block_h(group))


def flash_decode_partials(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    num_splits: int,
    out_dtype: torch.dtype = torch.float32,
    config: tuple[int, int, int] | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
    v_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV decode attention; returns the un-merged partial states.

    Inputs are validated by longctx.decode (shapes, dtypes, strides, page size).

    Args:
        q: [B, Hq, D] fp16/bf16/fp32, last-dim stride 1 (other strides arbitrary); cast to the
            cache dtype inside the kernel.
        k_cache, v_cache: contiguous [B, S_max, Hkv, D] (block_table None) or paged
            [num_pages, page_size, Hkv, D]; last-dim stride 1. Or float8_e4m3fn, with k_scale,
            v_scale float32 [B, S_max, Hkv] / [num_pages, page_size, Hkv] (any strides):
            key j of head h is k_cache[.., j, h, :] * k_scale[.., j, h] (V likewise); plus
            k_mean[b, h] (V: v_mean) for a smoothed cache (contiguous [B, Hkv, D] float32).
        cache_seqlens: [B] int32 on q's device, or None: every sequence holds `capacity` keys.
            A length outside [0, capacity] or a page id outside [0, num_pages) within the
            length makes that sequence's output NaN.
        block_table: None, or [B, max_pages] int32 (last-dim stride 1); logical position p
            of sequence b lives in page block_table[b, p // page_size], slot p % page_size.
        softmax_scale: multiplier applied to q.k (usually D ** -0.5).
        num_splits: KV chunks per sequence (>= 1; surplus splits are empty).
        out_dtype: dtype of o_part (float32 to merge; q's dtype when num_splits == 1).
        config: (BLOCK_N, num_warps, num_stages) override, for tuning sweeps.

    Returns:
        o_part [num_splits, B, Hq, D] out_dtype, each split's softmax-normalised output;
        lse_part [num_splits, B, Hq] float32 natural log. Empty splits: o = 0, lse = -inf.
    """
    B, Hq, D = q.shape
    launch = _split_launch(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale,
                           num_splits, out_dtype, config, k_scale=k_scale, v_scale=v_scale,
                           means=k_mean is not None)
    o_part = torch.empty((num_splits, B, Hq, D), device=q.device, dtype=out_dtype)
    lse_part = torch.empty((num_splits, B, Hq), device=q.device, dtype=torch.float32)
    sl = q if cache_seqlens is None else cache_seqlens
    bt = sl if block_table is None else block_table
    ks, vs = (lse_part, lse_part) if k_scale is None else (k_scale, v_scale)
    km, vm = (ks, vs) if k_mean is None else (k_mean, v_mean)
    # Tuning: Triton's launch path. o, lse and the counters (fused merge only) are not used.
    launch.generic(q, k_cache, v_cache, sl, bt, o_part, lse_part, o_part, lse_part, lse_part,
                   ks, vs, km, vm)
    return o_part, lse_part


class DecodePlan:
    """Flash-Decoding for one input signature: the split kernel's launch (merging its partials
    itself when the merge is fused), the merge kernel's (more than one split, merge not fused)
    and the buffers they write, computed once.

    Built from the shapes, strides, dtypes and devices of the inputs only (what longctx.decode
    keys its plan cache by), so a plan serves every call with that signature. Per call it
    needs the output (and the LSE when returned), a float32 scratch for the partial states
    (and the LSE when not returned) and, for a fused merge, zeroed arrival counters; it
    launches once (one split, or a fused merge) or twice. On the fast path the output (and the
    LSE when returned) are its only allocations, the scratch and the counters being the
    current stream's (`longctx.kernels.launch.stream_scratch` and `stream_counters`, which say
    why that is safe); Triton's path allocates them per call.
    """

    __slots__ = ("lse_shape", "return_lse", "scratch", "lse_part_off",
                 "lse_off", "num_splits", "split", "merge", "counters")

    def __init__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cache_seqlens: torch.Tensor | None, block_table: torch.Tensor | None,
                 softmax_scale: float, num_splits: int | None, return_lse: bool,
                 merge: str = "auto", k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, means: bool = False) -> None:
        B, Hq, D = q.shape[0], q.shape[-2], q.shape[-1]
        if num_splits is None:
            capacity = (block_table.shape[1] * k_cache.shape[1] if block_table is not None
                        else k_cache.shape[1])
            num_splits = choose_num_splits(
                B, k_cache.shape[2], capacity, device_sms(q.device),
                **splits_rule(D, k_scale is not None, q.device, key_major_rule(
                    k_scale is not None, v_cache,
                    None if block_table is None else k_cache.shape[1])))
        self.num_splits, self.return_lse = num_splits, return_lse
        self.lse_shape = tuple(q.shape[:-1])  # o without head_dim: [B, Hq] or [B, 1, Hq]
        rows = B * Hq
        # Scratch (float32): [o_part | lse_part] with more than one split, then the final LSE
        # when it is not returned. With one split the split kernel writes o and the LSE itself.
        self.lse_part_off = num_splits * rows * D if num_splits > 1 else 0
        self.lse_off = self.lse_part_off + num_splits * rows if num_splits > 1 else 0
        self.scratch = self.lse_off + (0 if return_lse else rows)
        self.split = self.merge = None
        self.counters = 0
        if rows == 0:
            return
        scales = dict(k_scale=k_scale, v_scale=v_scale, means=means)
        if num_splits == 1:
            self.split = _split_launch(q, k_cache, v_cache, cache_seqlens, block_table,
                                       softmax_scale, 1, q.dtype, **scales)
        elif fuse_merge(num_splits, merge):
            self.split = _split_launch(q, k_cache, v_cache, cache_seqlens, block_table,
                                       softmax_scale, num_splits, torch.float32, fused_merge=True,
                                       **scales)
            self.counters = fused_counters(q, k_cache)
        else:
            self.split = _split_launch(q, k_cache, v_cache, cache_seqlens, block_table,
                                       softmax_scale, num_splits, torch.float32, **scales)
            self.merge = merge_states_launch(num_splits, rows, D, (rows * D, D), (rows, 1),
                                             (torch.float32, torch.float32, q.dtype), q.device)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cache_seqlens: torch.Tensor | None, block_table: torch.Tensor | None,
                 device: int | None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, k_mean: torch.Tensor | None = None,
                 v_mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(o shaped like q in q's dtype, lse float32 shaped like o without head_dim ([B, Hq] or
        [B, 1, Hq]), or None when not return_lse).
        device: the current CUDA device for fast launches, None for Triton's path. k_scale,
        v_scale: an fp8 cache's scales (the plan was made with them); k_mean, v_mean: its
        smoothing means (the plan was made with means=True)."""
        dev = q.device
        # o has q's shape and dtype: empty_like parses its arguments in half torch.empty's time.
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=dev) if self.return_lse else None
        if self.split is None:
            return o, lse
        sl = q if cache_seqlens is None else cache_seqlens
        bt = sl if block_table is None else block_table
        if device is not None:
            qp = q.data_ptr()
            slp = qp if cache_seqlens is None else cache_seqlens.data_ptr()
            btp = slp if block_table is None else block_table.data_ptr()
            # The partials (and an LSE nobody asked for) in this stream's scratch: no allocation.
            # Held until the launches are queued (inside a graph capture it is an allocation).
            scratch = stream_scratch(4 * self.scratch, device, "decode") if self.scratch else None
            base = 0 if scratch is None else scratch.data_ptr()
            lp = base + 4 * self.lse_off if lse is None else lse.data_ptr()
            op = o.data_ptr()
            kp, vp = k_cache.data_ptr(), v_cache.data_ptr()
            # An fp8 cache's scales; otherwise o's pointer (never dereferenced; allocated here, so
            # aligned: the binary is the one without them).
            ksp, vsp = (op, op) if k_scale is None else (k_scale.data_ptr(), v_scale.data_ptr())
            kmp, vmp = (op, op) if k_mean is None else (k_mean.data_ptr(), v_mean.data_ptr())
            if self.num_splits == 1:
                self.split((qp, kp, vp, slp, btp, op, lp, op, lp, lp, ksp, vsp, kmp, vmp), device)
            elif self.merge is None:  # fused merge
                counters = stream_counters(self.counters, device)
                self.split((qp, kp, vp, slp, btp, base, base + 4 * self.lse_part_off, op, lp,
                            counters.data_ptr(), ksp, vsp, kmp, vmp), device)
            else:
                lpp = base + 4 * self.lse_part_off
                self.split((qp, kp, vp, slp, btp, base, lpp, op, lp, lp, ksp, vsp, kmp, vmp),
                           device)
                self.merge((base, lpp, op, lp), device)
            return o, lse
        scratch = torch.empty(self.scratch, dtype=torch.float32, device=dev) if self.scratch else None
        lse_out = lse if lse is not None else scratch[self.lse_off:]
        ks, vs = (lse_out, lse_out) if k_scale is None else (k_scale, v_scale)
        km, vm = (ks, vs) if k_mean is None else (k_mean, v_mean)
        if self.num_splits == 1:
            self.split.generic(q, k_cache, v_cache, sl, bt, o, lse_out, o, lse_out, lse_out, ks, vs,
                               km, vm)
            return o, lse
        o_part = scratch[:self.lse_part_off]
        lse_part = scratch[self.lse_part_off:self.lse_off]
        if self.merge is None:  # fused merge
            counters = torch.zeros(self.counters, dtype=torch.int32, device=dev)
            self.split.generic(q, k_cache, v_cache, sl, bt, o_part, lse_part, o, lse_out, counters,
                               ks, vs, km, vm)
        else:
            self.split.generic(q, k_cache, v_cache, sl, bt, o_part, lse_part, o, lse_out, lse_out,
                               ks, vs, km, vm)
            self.merge.generic(o_part, lse_part, o, lse_out)
        return o, lse


# How DecodePlan merges more than one split: "fused" (the split kernel's last program per
# group, one launch), "separate" (the merge layer's kernel, a second launch) or "auto": fused
# up to FUSED_MERGE_MAX_SPLITS splits. Measured on an H200 (fp16, 16/2 heads, D=128, graph
# replay, µs per call, separate -> fused): 2 splits 22.0 -> 20.6-21.0, 4 splits 20.8 -> 20.7,
# 8 splits 20.8 -> 23.2, 16 splits 21.0 -> 24.4, 64 splits 20.9 -> 28.7. The fused merge
# runs on B * Hkv programs after the others have finished, one split after another; the
# separate kernel spreads it over B * Hq * D / 32 programs and starts early (PDL). Eager, one
# launch saves ~3 µs of host time (bench/host_time.py). LONGCTX_DECODE_MERGE overrides "auto"
# for A/B measurements.
FUSED_MERGE_MAX_SPLITS = 4
DECODE_MERGE = os.environ.get("LONGCTX_DECODE_MERGE", "auto")


def fuse_merge(num_splits: int, merge: str = "auto") -> bool:
    """Whether a decode over num_splits > 1 splits merges inside the split kernel: `merge`, or
    with "auto" DECODE_MERGE, or with "auto" there num_splits <= FUSED_MERGE_MAX_SPLITS."""
    if merge == "auto":
        merge = DECODE_MERGE
    if merge not in ("auto", "fused", "separate"):
        raise ValueError(f"decode merge must be 'auto', 'fused' or 'separate', got {merge!r}")
    return merge == "fused" or (merge == "auto" and num_splits <= FUSED_MERGE_MAX_SPLITS)


def flash_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    num_splits: int | None,
    merge: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
    v_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-Decoding: split kernel, then the merge of the splits (`merge`: "fused" in the
    split kernel, "separate" by the merge layer's kernel, "auto" as `fuse_merge` decides).

    q [B, Hq, D] or [B, 1, Hq, D]. Returns o shaped like q in q's dtype and lse float32 natural log
    shaped like o without head_dim ([B, Hq] or [B, 1, Hq]). With one split the split kernel writes
    the final output directly (no merge). cache_seqlens None: every sequence is full. An fp8 cache
    takes its scales (k_scale, v_scale) and a smoothed one its means (k_mean, v_mean; see
    flash_decode_partials).

    Launches through Triton's generic path; longctx.decode caches the DecodePlan per input
    signature and launches directly.
    """
    plan = DecodePlan(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale,
                      num_splits, return_lse=True, merge=merge, k_scale=k_scale, v_scale=v_scale,
                      means=k_mean is not None)
    return plan(q, k_cache, v_cache, cache_seqlens, block_table, None, k_scale, v_scale, k_mean,
                v_mean)


# choose_num_splits' arguments for an fp8 cache, swept on an H100 (bench/results/
# fp8-decode-sweep-h100.txt, fp8-decode-warps-h100.txt): four programs of 2 warps per SM (its
# kernel runs more dependent steps per byte than the bf16 one and hides them better with more,
# smaller programs: two per SM were 5-16% faster than one from 2048 keys a split, four of 2 warps
# 3-6% faster than two of 4), up to 256 splits, while splits keep >= 1024 keys (at 512 keys,
# 64 x 1024 with 16/2 heads, two per SM lose 22%).
FP8_SPLITS = dict(programs_per_sm=4, min_keys_per_split=1024, max_splits=256)
# An fp8 cache whose V is key-major (longctx.fp8): two programs of 4 warps per SM
# (`_launch_config`; the probe in bench/results/fp8-decode-h200.txt).
KEY_MAJOR_SPLITS = dict(programs_per_sm=2, min_keys_per_split=1024)
# Pages of fewer keys than this take the usual layout's launch rule with a key-major V (below).
KEY_MAJOR_MIN_PAGE = 128
# A head_dim split into two tiles on a GPU not named H100 (`splits_rule`): two programs per SM.
SPLIT_HEAD_SPLITS = dict(programs_per_sm=2, min_keys_per_split=1024)


def _pages_hold_blocks(page_size: int | None) -> bool:
    """A contiguous cache (None), or pages of at least KEY_MAJOR_MIN_PAGE keys."""
    return page_size is None or page_size >= KEY_MAJOR_MIN_PAGE


def key_major_rule(fp8: bool, v_cache: torch.Tensor, page_size: int | None) -> bool:
    """Whether an fp8 cache's launch takes the key-major rule (KEY_MAJOR_SPLITS, `_launch_config`'s
    two programs of 128 keys a SM): its V key-major, contiguous or in pages of at least
    KEY_MAJOR_MIN_PAGE keys. Smaller pages take the usual layout's splits (FP8_SPLITS): on an H200
    at pages of 16, four programs of (64, 2, 3) a SM took 58.2 / 100.1 / 186.5 µs at 16/2, 32/4,
    64/8 heads 1 x 262144 against 61.0 / 110.6 / 208.7 for the key-major rule (a key block then
    spans several pages, its rows' page ids loaded first; bench/results/fp8-paged-h200.txt)."""
    return fp8 and is_key_major(v_cache) and _pages_hold_blocks(page_size)


def splits_rule(head_dim: int, fp8: bool, device: torch.device, key_major: bool = False) -> dict:
    """choose_num_splits' arguments for a decode kernel: FP8_SPLITS (four programs per SM while
    splits keep >= 1024 keys) for an fp8 cache, KEY_MAJOR_SPLITS (two per SM) when its V is
    key-major, SPLIT_HEAD_SPLITS (two per SM, the same bound) for a head_dim split into two
    tiles (`head_tiles`: 96 = 64 + 32) on a GPU not named H100; else {} (one wave).

    The split head's loop issues two dots per key block and, like the fp8 loop, runs better with
    more than one program to an SM where splits are long. Swept on an H200 at D=96, 16/2 heads
    (bench/results/tune-decode-d96-h200-splits.txt, then bench/decode_ab.py against the one-wave
    rule, bench/results/decode-ab-d96-h200.txt): 1 x 262144 took 58.1 µs with 128 splits of
    64-key blocks against 62.2 with 64 of 128 (cuDNN 57.7); at 512 keys a split, two per SM
    gained 2% at 1 x 65536 and lost 1.5% at 8 x 8192, so splits stay >= 1024 keys. On an H100
    128 splits were 1.5% slower at 1 x 262144 (bench/results/tune-decode-d96-split-h100.txt)."""
    if fp8:
        return KEY_MAJOR_SPLITS if key_major else FP8_SPLITS
    if head_tiles(head_dim, SPLIT_HEADS)[1] and "H100" not in device_name(device):
        return SPLIT_HEAD_SPLITS
    return {}


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_seqlen_capacity: int,
    num_sms: int,
    *,
    min_keys_per_split: int = 256,
    max_splits: int = 128,
    programs_per_sm: int = 1,
) -> int:
    """num_splits for flash_decode from static sizes only (capacity, not current lengths), so
    the launch grid -- and a captured CUDA graph -- stays valid as sequences grow.

    Decode is bandwidth-bound and each (batch, kv_head) program streams its split at about
    one SM's share of HBM bandwidth, so the target is one wave: batch * kv_heads * splits close
    to the SM count. Measured on an H200 (132 SMs, bench/tune_decode.py): the best split
    count was the largest power of two <= num_sms / (batch * kv_heads) at every shape of the
    Flash-Decoding table (1 for 64 x 2 programs ... 64 for 1 x 2), within 1 µs of the best
    elsewhere; more splits add merge work, fewer leave SMs idle. Splits keep at least
    `min_keys_per_split` keys. `programs_per_sm` > 1 aims at that many programs per SM instead
    (`splits_rule`: an fp8 cache's kernel or a head in two tiles, two programs sharing an SM).
    """
    base = max(1, batch * num_kv_heads)
    want = max(1, programs_per_sm * num_sms // base)
    want = 1 << (want.bit_length() - 1)  # largest power of two <= num_sms / base
    by_length = max(1, max_seqlen_capacity // min_keys_per_split)
    return int(max(1, min(want, by_length, max_splits)))
