"""Small fused Triton kernels for the model's decode step: RMSNorm, rotary embedding of q and k,
SiLU-and-multiply, the KV-cache store, and RoPE with the KV-cache store in one kernel (what a
decode step runs; prefill rotates with rope_ and stores with tensor copies, or into an fp8 cache
with store_fp8). Writing an fp8 cache quantizes in the writing kernel (longctx.fp8's rule).

At batch 1 a Llama layer's non-matmul ops are dozens of tiny kernels (RMSNorm alone is eight
torch ops); each costs a launch and a ramp, a few µs, against ~0.45 ms of weight reads per
layer. One kernel each keeps the decode step close to the bandwidth limit. The math matches the
torch versions in longctx.ops (which the CPU runs, and which tests compare against).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longctx.fp8 import FP8, is_key_major
from longctx.kernels.utils import FP_FUSION, cdiv, next_power_of_2, pdl_launch, pdl_wait


@triton.jit
def _rms_norm_kernel(X, A, S, W, Y, stride_x, stride_a, stride_s, stride_y, N, eps,
                     HAS_ADD: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # One program per row: y = w * (x / sqrt(mean(x^2) + eps)), normalised in fp32, rounded to
    # the input dtype before the weight multiply (as the Llama reference does). With HAS_ADD the
    # row is first x + a, rounded to the dtype and also stored to S (the residual stream), so a
    # residual add and the next norm are one launch.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(W + offs, mask=mask, other=0.0)  # a weight: no kernel writes it
    pdl_wait(USE_PDL)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_ADD:
        a = tl.load(A + row * stride_a + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + a.to(tl.float32)).to(Y.dtype.element_ty)
        tl.store(S + row * stride_s + offs, x, mask=mask)
    x = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    xn = (x * inv).to(Y.dtype.element_ty)
    tl.store(Y + row * stride_y + offs, (w.to(tl.float32) * xn.to(tl.float32)).to(Y.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             add: torch.Tensor | None = None):
    """x [..., N] (last stride 1), weight [N] -> [..., N] in x's dtype; with `add` (x's shape,
    last stride 1) -> (x + add, its norm)."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    y = torch.empty_like(x2)
    a2 = add.reshape(-1, N) if add is not None else x2
    s2 = torch.empty_like(x2) if add is not None else y
    BLOCK = next_power_of_2(N)
    _rms_norm_kernel[(x2.shape[0],)](x2, a2, s2, weight, y, x2.stride(0), a2.stride(0),
                                     s2.stride(0), y.stride(0), N, eps, HAS_ADD=add is not None,
                                     BLOCK=BLOCK, num_warps=min(16, max(1, BLOCK // 512)),
                                     **pdl_launch(x.device))
    if add is None:
        return y.view(x.shape)
    return s2.view(x.shape), y.view(x.shape)


@triton.jit
def _cols_mask(rows, N: tl.constexpr, BLOCK: tl.constexpr):
    # The row mask rows [BLOCK_H, 1] limited to the first N of BLOCK columns, BLOCK being N
    # padded to a power of two (head_dim 96, 80, ...): `rows` itself when nothing is padded.
    if N == BLOCK:
        return rows
    else:
        return rows & (tl.arange(0, BLOCK) < N)[None, :]


@triton.jit
def _rope_angles(COS, SIN, POS, stride_t, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # The fp32 cos and sin [BLOCK_HALF] of the position at POS (a [max_seq_len, D] table's first
    # half: rotate-half tables repeat it; padding columns read 0).
    pos = tl.load(POS).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    if HALF == BLOCK_HALF:
        return tl.load(COS + pos * stride_t + offs_d), tl.load(SIN + pos * stride_t + offs_d)
    else:
        m = offs_d < HALF
        return (tl.load(COS + pos * stride_t + offs_d, mask=m, other=0.0),
                tl.load(SIN + pos * stride_t + offs_d, mask=m, other=0.0))


@triton.jit
def _rotate_rows_(base, cos, sin, mask, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # Rotate-half RoPE of the rows at `base` ([BLOCK_H, 1] pointers to each head's first
    # element) in place: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin in fp32 (cos/sin
    # [BLOCK_HALF] fp32), rounded to the rows' dtype. `mask` [BLOCK_H, 1 or BLOCK_HALF]: the
    # rows (and half-head columns) to touch. Returns the rotated halves (x1', x2') in that dtype.
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    x1 = tl.load(base + offs_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + offs_d, mask=mask, other=0.0).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(base.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(base.dtype.element_ty)
    tl.store(base + offs_d, y1, mask=mask)
    tl.store(base + HALF + offs_d, y2, mask=mask)
    return y1, y2


@triton.jit
def _rope_kernel(X, COS, SIN, POS, stride_xb, stride_xs, stride_xh, stride_pb, stride_ps,
                 S, H, stride_t, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    # One program per (token, block of heads): rotate-half RoPE in place.
    pdl_wait(USE_PDL)
    t = tl.program_id(0)
    b = (t // S).to(tl.int64)
    s = (t % S).to(tl.int64)
    cos, sin = _rope_angles(COS, SIN, POS + b * stride_pb + s * stride_ps, stride_t, HALF,
                            BLOCK_HALF)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = _cols_mask((offs_h < H)[:, None], HALF, BLOCK_HALF)
    base = X + b * stride_xb + s * stride_xs + offs_h[:, None].to(tl.int64) * stride_xh
    _rotate_rows_(base, cos, sin, mask, HALF, BLOCK_HALF)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] (last stride 1, D even) in place by the positions pos [B, S] (any
    strides, e.g. expanded); cos/sin are the [max_seq_len, D] float32 tables. Returns x."""
    B, S, H, D = x.shape
    BLOCK_H = min(next_power_of_2(H), 16)
    _rope_kernel[(B * S, cdiv(H, BLOCK_H))](
        x, cos, sin, pos, x.stride(0), x.stride(1), x.stride(2), pos.stride(0), pos.stride(1),
        S, H, cos.stride(0), HALF=D // 2, BLOCK_HALF=next_power_of_2(D // 2), BLOCK_H=BLOCK_H,
        num_warps=2, **pdl_launch(x.device))
    return x


@triton.jit
def _silu_mul_kernel(GU, Y, I, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # Row r of GU holds [gate (I) | up (I)]: y = silu(gate) * up, silu in fp32 rounded to the
    # input dtype first (as F.silu(gate) * up does).
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(GU + row * 2 * I + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * I + I + offs, mask=mask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * I + offs, (a * u).to(Y.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] contiguous -> silu(gate) * up [..., I]."""
    I = gate_up.shape[-1] // 2
    y = gate_up.new_empty(*gate_up.shape[:-1], I)
    rows = gate_up.numel() // (2 * I)
    BLOCK = 1024
    _silu_mul_kernel[(rows, cdiv(I, BLOCK))](gate_up, y, I, BLOCK=BLOCK, num_warps=4,
                                                     **pdl_launch(gate_up.device))
    return y


@triton.jit
def _fp8_scale(amax):
    # The fp8 cache's scale of rows whose |max| is amax (float32), and the divisor that maps them
    # onto e4m3's range: longctx.fp8.quantize_fp8's rule (scale = amax / 448; x / divisor in
    # float32). A zero row divides by 1: scale 0 and zeros, never NaN.
    scale = _div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    return scale, tl.where(scale == 0.0, 1.0, scale)


@triton.jit
def _div_rn(a, b):
    # a / b rounded to nearest, as torch divides: Triton's `/` on float32 is the approximate
    # division (up to 2 ulp), which moves some values across an e4m3 rounding boundary.
    return tl.math.div_rn(a, tl.broadcast_to(b, a.shape))


@triton.jit
def _div_rows(a, b):
    # a [R, C] / b [R] (float32, b > 0 as _fp8_scale's divisors are), rounded to nearest as
    # _div_rn. libdevice's div_rn is ~30 instructions and a branch per element: rope_store_kv
    # spent ~10 us in its 64 per thread. Instead one correctly rounded reciprocal y per row,
    # then q = a y corrected twice by the remainder a - b q, which an FMA computes exactly:
    # Markstein's theorem makes the second q the rounded quotient when y is within half an ulp
    # of 1 / b, q is within an ulp, and nothing underflows. Rows with b < 2^-40 are scaled by
    # 2^100 first (exact) so that the remainders of quotients >= 2^-11 stay representable;
    # smaller quotients round to zero in e4m3 either way. A row holding inf or NaN comes out
    # NaN (its scale, inf or NaN, dequantizes it to NaN whatever the bits).
    s = tl.where(b < 9.094947017729282e-13, 1.2676506002282294e+30, 1.0)
    b = b * s
    a = a * s[:, None]
    y = tl.math.div_rn(tl.full(b.shape, 1.0, tl.float32), b)[:, None]
    b = b[:, None]
    q0 = a * y
    q = tl.fma(tl.fma(-b, q0, a), y, q0)
    q = tl.fma(tl.fma(-b, q, a), y, q)
    return tl.where(q == 0.0, q0, q)  # a zero keeps a's sign (the FMAs would make -0 +0)


@triton.jit
def _head_tile(bh, j, H, SEQ, BLOCK_S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    # The tile of program (bh = b * H + h, j) over one head's tokens: (b, h, rows [BLOCK_S] int64,
    # offs_d [BLOCK_D], mask [BLOCK_S, BLOCK_D]) for tokens [j BLOCK_S, (j + 1) BLOCK_S) < SEQ.
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = j.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    return b, h, rows, offs_d, _cols_mask((rows < SEQ)[:, None], D, BLOCK_D)


@triton.jit
def _store_fp8_kernel(X, Y, S, MEAN, stride_xb, stride_xs, stride_xh, stride_yb, stride_ys,
                      stride_yh, stride_yd, stride_sb, stride_ss, stride_sh, SEQ, H,
                      BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      USE_PDL: tl.constexpr, HAS_MEAN: tl.constexpr = False):
    # One program per token t = b * SEQ + s: its H heads quantized (one scale per head), the fp8
    # rows to Y (any strides: stride_yd is 1, a constant once specialised, unless Y is a
    # key-major V) and the scales to S (any strides). HAS_MEAN: less MEAN [B, H, D] float32
    # (contiguous; longctx.fp8's smoothing).
    pdl_wait(USE_PDL)
    t = tl.program_id(0)
    b = (t // SEQ).to(tl.int64)
    s = (t % SEQ).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = _cols_mask((offs_h < H)[:, None], D, BLOCK_D)
    head = offs_h[:, None].to(tl.int64)
    x = tl.load(X + b * stride_xb + s * stride_xs + head * stride_xh + offs_d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    if HAS_MEAN:
        x -= tl.load(MEAN + (b * H + head) * D + offs_d[None, :], mask=mask, other=0.0)
    scale, div = _fp8_scale(tl.max(tl.abs(x), axis=1))
    y_cols = offs_d[None, :].to(tl.int64) * stride_yd
    tl.store(Y + b * stride_yb + s * stride_ys + head * stride_yh + y_cols,
             _div_rows(x, div).to(Y.dtype.element_ty), mask=mask)
    tl.store(S + b * stride_sb + s * stride_ss + offs_h.to(tl.int64) * stride_sh, scale,
             mask=offs_h < H)


@triton.jit
def _store_fp8_keys_kernel(X, Y, S, MEAN, stride_xb, stride_xs, stride_xh, stride_yb,
                           stride_yh, stride_yd, stride_sb, stride_ss, stride_sh, SEQ, H,
                           BLOCK_S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                           USE_PDL: tl.constexpr, HAS_MEAN: tl.constexpr = False):
    # `_store_fp8_kernel` into a key-major Y (unit stride along tokens): program (b * H + h, j)
    # quantizes tokens [j BLOCK_S, (j + 1) BLOCK_S) of head h, each row with its own scale, and
    # writes the tile transposed, so that each head_dim column's bytes go out as runs of
    # BLOCK_S keys (one program per token would store every byte alone: a prefill chunk's
    # write scattered over D rows).
    pdl_wait(USE_PDL)
    b, h, rows, offs_d, mask = _head_tile(tl.program_id(0), tl.program_id(1), H, SEQ, BLOCK_S, D,
                                          BLOCK_D)
    x = tl.load(X + b * stride_xb + h * stride_xh + rows[:, None] * stride_xs + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    if HAS_MEAN:
        x -= tl.load(MEAN + (b * H + h) * D + offs_d, mask=offs_d < D, other=0.0)[None, :]
    scale, div = _fp8_scale(tl.max(tl.abs(x), axis=1))
    y = Y + b * stride_yb + h * stride_yh + offs_d[None, :].to(tl.int64) * stride_yd + rows[:, None]
    tl.store(y, _div_rows(x, div).to(Y.dtype.element_ty), mask=mask)
    tl.store(S + b * stride_sb + h * stride_sh + rows * stride_ss, scale, mask=rows < SEQ)


def store_fp8(dst: torch.Tensor, dst_scale: torch.Tensor, x: torch.Tensor,
              mean: torch.Tensor | None = None) -> None:
    """dst, dst_scale = quantize_kv(x, mean[:, None]): x [B, S, H, D] (unit stride in D) into
    the fp8 view dst [B, S, H, D] (any strides: e.g. a key-major V, longctx.fp8, written in
    tiles of tokens) and its float32 scales dst_scale [B, S, H] (any strides), in one pass;
    mean: None or contiguous [B, H, D] float32 (longctx.fp8's smoothing)."""
    B, S, H, D = x.shape
    if B * S == 0:
        return
    m = dict(HAS_MEAN=True) if mean is not None else {}
    mean = dst_scale if mean is None else mean  # a dummy, never dereferenced
    if is_key_major(dst):
        block_s = 64
        _store_fp8_keys_kernel[(B * H, cdiv(S, block_s))](
            x, dst, dst_scale, mean, x.stride(0), x.stride(1), x.stride(2), dst.stride(0),
            dst.stride(2), dst.stride(3), dst_scale.stride(0), dst_scale.stride(1),
            dst_scale.stride(2), S, H, BLOCK_S=block_s, D=D, BLOCK_D=next_power_of_2(D),
            num_warps=4, **m, **pdl_launch(x.device))
        return
    _store_fp8_kernel[(B * S,)](
        x, dst, dst_scale, mean, x.stride(0), x.stride(1), x.stride(2), dst.stride(0), dst.stride(1),
        dst.stride(2), dst.stride(3), *dst_scale.stride(), S, H,
        BLOCK_H=next_power_of_2(H), D=D, BLOCK_D=next_power_of_2(D),
        num_warps=4 if H * D >= 2048 else 2, **m, **pdl_launch(x.device))


@triton.jit
def _dequantize_fp8_kernel(X, S, Y, MEAN, stride_xb, stride_xs, stride_xh, stride_xd, stride_sb,
                           stride_ss, stride_sh, SEQ, H, BLOCK_S: tl.constexpr, D: tl.constexpr,
                           BLOCK_D: tl.constexpr, HAS_MEAN: tl.constexpr = False):
    # Program (j, b * H + h): tokens [j BLOCK_S, (j + 1) BLOCK_S) of head h, x * scale in float32
    # rounded to Y's dtype (longctx.fp8.dequantize_kv's rule, so bit for bit), into Y contiguous
    # [B, SEQ, H, D]. X takes any strides; a unit one (D's, or a key-major V's tokens) is
    # specialised, so the loads run along it and the tile is transposed on chip for the store.
    # HAS_MEAN: x * scale + MEAN[b, h] ([B, H, D] float32, contiguous) in one fused multiply-add.
    b, h, rows, offs_d, mask = _head_tile(tl.program_id(1), tl.program_id(0), H, SEQ, BLOCK_S, D,
                                          BLOCK_D)
    x = tl.load(X + b * stride_xb + h * stride_xh + rows[:, None] * stride_xs
                + offs_d[None, :].to(tl.int64) * stride_xd, mask=mask, other=0.0)
    scale = tl.load(S + b * stride_sb + h * stride_sh + rows * stride_ss, mask=rows < SEQ,
                    other=0.0)
    if HAS_MEAN:
        mean = tl.load(MEAN + (b * H + h) * D + offs_d, mask=offs_d < D, other=0.0)
        y = tl.fma(x.to(tl.float32), scale[:, None], mean[None, :])
    else:
        y = x.to(tl.float32) * scale[:, None]
    tl.store(Y + ((b * SEQ + rows[:, None]) * H + h) * D + offs_d[None, :],
             y.to(Y.dtype.element_ty), mask=mask)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                   mean: torch.Tensor | None = None) -> torch.Tensor:
    """out = longctx.fp8.dequantize_kv(x, scale, out.dtype, mean[:, None]), bit for bit, in one
    pass with no float32 temporaries: x [B, S, H, D] float8_e4m3fn (any strides: the model's
    head-major K or key-major V), scale [B, S, H] float32 (any strides), mean None or
    contiguous [B, H, D] float32 (smoothing), out contiguous [B, S, H, D] (float16, bfloat16 or
    float32). Returns out."""
    B, S, H, D = x.shape
    if x.dtype != FP8:
        raise ValueError(f"x must be float8_e4m3fn (an fp8 cache), got {x.dtype}")
    if scale.shape != x.shape[:3]:
        raise ValueError(f"scale must be [B, S, H] = {list(x.shape[:3])} (one per token and head "
                         f"of x), got {list(scale.shape)}")
    if out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"out must be contiguous of x's shape {tuple(x.shape)}, got "
                         f"{tuple(out.shape)} with strides {out.stride()}")
    if B * S == 0:
        return out
    block_d = next_power_of_2(D)
    # 16384 elements a program: 128 keys at D = 128, whole 128-byte lines of a key-major V
    block_s = max(32, 16384 // block_d)
    _dequantize_fp8_kernel[(cdiv(S, block_s), B * H)](
        x, scale, out, scale if mean is None else mean, *x.stride(), *scale.stride(), S, H,
        BLOCK_S=block_s, D=D, BLOCK_D=block_d, num_warps=8,
        **({} if mean is None else dict(HAS_MEAN=True)), **FP_FUSION)
    return out


@triton.jit
def _store_kv_kernel(KC, VC, K, V, SLOT, S_MAX, stride_cb, stride_cs, stride_ch,
                     stride_kb, stride_kh, stride_vb, stride_vh, H,
                     BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     USE_PDL: tl.constexpr):
    # Program (b, 0) writes k[b] and (b, 1) writes v[b] at cache position SLOT[b]; a slot out of
    # range is skipped (the decode that follows flags its sequence with NaN). BLOCK_D: D padded
    # to a power of two.
    pdl_wait(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOT + b).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # where, not `&`: a scalar comparison and-ed into a mask is refused by Triton 3.9's interpreter
    mask = tl.where((slot >= 0) & (slot < S_MAX), _cols_mask((offs_h < H)[:, None], D, BLOCK_D),
                    False)
    if tl.program_id(1) == 0:
        src = K + b * stride_kb + offs_h[:, None] * stride_kh + offs_d[None, :]
        dst = KC + b * stride_cb + slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    else:
        src = V + b * stride_vb + offs_h[:, None] * stride_vh + offs_d[None, :]
        dst = VC + b * stride_cb + slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot: torch.Tensor) -> None:
    """k_cache[b, slot[b]] = k[b], v_cache[b, slot[b]] = v[b]; caches [B, S_max, Hkv, D]
    contiguous, k/v [B, Hkv, D] with unit stride in D, slot [B] int64."""
    B, S_max, H, D = k_cache.shape
    _store_kv_kernel[(B, 2)](k_cache, v_cache, k, v, slot, S_max, k_cache.stride(0),
                             k_cache.stride(1), k_cache.stride(2), k.stride(0), k.stride(1),
                             v.stride(0), v.stride(1), H, BLOCK_H=next_power_of_2(H), D=D,
                             BLOCK_D=next_power_of_2(D), num_warps=4, **pdl_launch(k.device))


@triton.jit
def _rope_store_kv_kernel(Q, K, V, COS, SIN, POS, KC, VC, SLOT, KS, VS, KM, VM, S_MAX,
                          stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                          stride_p, stride_t, stride_kcb, stride_kcs, stride_kch, stride_kcd,
                          stride_vcb, stride_vcs, stride_vch, stride_vcd, stride_sb,
                          stride_ss, stride_sh, HQ, HKV,
                          HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                          USE_PDL: tl.constexpr, FP8: tl.constexpr = False,
                          HAS_MEAN: tl.constexpr = False):
    # A decode step's RoPE and KV store, one token per sequence b = program_id(0): programs
    # j < cdiv(HQ, BLOCK_H) rotate a block of q heads in place (as _rope_kernel); the others
    # rotate a block of k heads in place too and write them and the same v heads at cache
    # position SLOT[b], skipping a slot out of range (as _store_kv_kernel). Each cache has its
    # own strides (b, s, h, d); a head_dim stride of 1 is a constant once specialised, anything
    # else is a key-major V (longctx.fp8). HAS_MEAN: an fp8 cache smoothed by KM / VM
    # [B, HKV, 2 HALF] float32 (contiguous), subtracted from the rotated k and from v.
    pdl_wait(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    cos, sin = _rope_angles(COS, SIN, POS + b * stride_p, stride_t, HALF, BLOCK_HALF)
    n_qb = tl.cdiv(HQ, BLOCK_H)
    j = tl.program_id(1)
    if j < n_qb:
        offs_q = j * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_rows_(Q + b * stride_qb + offs_q[:, None].to(tl.int64) * stride_qh, cos, sin,
                      _cols_mask((offs_q < HQ)[:, None], HALF, BLOCK_HALF), HALF, BLOCK_HALF)
    else:
        offs_h = (j - n_qb) * BLOCK_H + tl.arange(0, BLOCK_H)
        head = offs_h[:, None].to(tl.int64)
        k1, k2 = _rotate_rows_(K + b * stride_kb + head * stride_kh, cos, sin,
                               _cols_mask((offs_h < HKV)[:, None], HALF, BLOCK_HALF), HALF,
                               BLOCK_HALF)
        slot = tl.load(SLOT + b).to(tl.int64)
        # where, not `&`: a scalar comparison and-ed into a mask is refused by Triton 3.9's
        # interpreter
        mask = tl.where((slot >= 0) & (slot < S_MAX),
                        _cols_mask((offs_h < HKV)[:, None], HALF, BLOCK_HALF), False)
        offs_d = tl.arange(0, BLOCK_HALF)[None, :]
        cols = offs_d.to(tl.int64)
        k_dst = KC + b * stride_kcb + slot * stride_kcs + head * stride_kch + cols * stride_kcd
        v_dst = VC + b * stride_vcb + slot * stride_vcs + head * stride_vch + cols * stride_vcd
        k_hi, v_hi = HALF * stride_kcd, HALF * stride_vcd  # the second half-head's offset
        src = V + b * stride_vb + head * stride_vh + offs_d
        if FP8:
            # Quantize the rotated k (rounded to k's dtype, as stored otherwise) and v: one
            # scale per head over both halves (longctx.fp8.quantize_kv), written beside them.
            dst_s = b * stride_sb + slot * stride_ss + offs_h.to(tl.int64) * stride_sh
            s_mask = tl.where((slot >= 0) & (slot < S_MAX), offs_h < HKV, False)
            k1, k2 = k1.to(tl.float32), k2.to(tl.float32)
            v1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            v2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
            if HAS_MEAN:
                m_off = (b * HKV + head) * (2 * HALF) + offs_d
                k1 -= tl.load(KM + m_off, mask=mask, other=0.0)
                k2 -= tl.load(KM + m_off + HALF, mask=mask, other=0.0)
                v1 -= tl.load(VM + m_off, mask=mask, other=0.0)
                v2 -= tl.load(VM + m_off + HALF, mask=mask, other=0.0)
            k_scale, k_div = _fp8_scale(tl.maximum(tl.max(tl.abs(k1), axis=1),
                                                   tl.max(tl.abs(k2), axis=1)))
            v_scale, v_div = _fp8_scale(tl.maximum(tl.max(tl.abs(v1), axis=1),
                                                   tl.max(tl.abs(v2), axis=1)))
            tl.store(KS + dst_s, k_scale, mask=s_mask)
            tl.store(VS + dst_s, v_scale, mask=s_mask)
            tl.store(k_dst, _div_rows(k1, k_div).to(KC.dtype.element_ty), mask=mask)
            tl.store(k_dst + k_hi, _div_rows(k2, k_div).to(KC.dtype.element_ty),
                     mask=mask)
            tl.store(v_dst, _div_rows(v1, v_div).to(VC.dtype.element_ty), mask=mask)
            tl.store(v_dst + v_hi, _div_rows(v2, v_div).to(VC.dtype.element_ty),
                     mask=mask)
        else:
            tl.store(k_dst, k1, mask=mask)
            tl.store(k_dst + k_hi, k2, mask=mask)
            tl.store(v_dst, tl.load(src, mask=mask), mask=mask)
            tl.store(v_dst + v_hi, tl.load(src + HALF, mask=mask), mask=mask)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, k_mean: torch.Tensor | None = None,
                  v_mean: torch.Tensor | None = None) -> None:
    """rope_ of q [B, Hq, D] and k [B, Hkv, D] in place at positions pos [B] (any stride), then
    store_kv of k and v [B, Hkv, D] at slot [B] int64: one launch. q/k/v unit stride in D;
    caches [B, S_max, Hkv, D] of any strides (e.g. an fp8 V stored key-major, longctx.fp8);
    cos/sin the [max_seq_len, D] float32 tables. An fp8 cache (float8_e4m3fn) stores
    quantize_kv of k and v, their scales to k_scale / v_scale [B, S_max, Hkv] float32 (both of
    the same strides, any: e.g. longctx.fp8.head_major, the model's), smoothed by k_mean /
    v_mean [B, Hkv, D] float32 (contiguous) if given: quantize_kv(k, k_mean) of the rotated k."""
    B, HQ, D = q.shape
    HKV = k.shape[1]
    BLOCK_H = min(next_power_of_2(HQ), 16)
    fp8 = k_scale is not None
    ks, vs = (k_scale, v_scale) if fp8 else (slot, slot)  # dummies, never dereferenced
    km, vm = (k_mean, v_mean) if k_mean is not None else (ks, vs)
    _rope_store_kv_kernel[(B, cdiv(HQ, BLOCK_H) + cdiv(HKV, BLOCK_H))](
        q, k, v, cos, sin, pos, k_cache, v_cache, slot, ks, vs, km, vm, k_cache.shape[1],
        q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), pos.stride(0),
        cos.stride(0), *k_cache.stride(), *v_cache.stride(),
        *(ks.stride() if fp8 else (0, 0, 0)), HQ, HKV,
        HALF=D // 2, BLOCK_HALF=next_power_of_2(D // 2), BLOCK_H=BLOCK_H, FP8=fp8, num_warps=2,
        **({} if k_mean is None else dict(HAS_MEAN=True)), **pdl_launch(q.device))


@triton.jit
def _add_kv_means_kernel(O, LSE, Q, KM, VM, sm_scale, T, SEQ,
                         stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                         stride_qb, stride_qs, stride_qh, HKV, GROUP: tl.constexpr,
                         D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program (j, h): tokens t = b * SEQ + s in [j BLOCK_T, (j + 1) BLOCK_T) of query head h.
    # longctx.fp8.add_kv_means in one pass: o += v_mean where lse > -inf, lse += sm_scale q.k_mean
    # (KV head h // GROUP of each token's sequence; the means contiguous [B, HKV, D] float32).
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    b = (t // SEQ).to(tl.int64)
    s = (t % SEQ).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok = t < T
    mask = _cols_mask(t_ok[:, None], D, BLOCK_D)
    cols = offs_d[None, :]
    means = ((b * HKV + h // GROUP) * D)[:, None] + cols
    q = tl.load(Q + (b * stride_qb + s * stride_qs + h * stride_qh)[:, None] + cols, mask=mask,
                other=0.0).to(tl.float32)
    q_km = tl.sum(q * tl.load(KM + means, mask=mask, other=0.0), axis=1)
    lse_ptrs = LSE + b * stride_lb + s * stride_ls + h * stride_lh
    lse = tl.load(lse_ptrs, mask=t_ok, other=0.0)
    o_ptrs = O + (b * stride_ob + s * stride_os + h * stride_oh)[:, None] + cols
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    o = tl.where((lse != float("-inf"))[:, None], o + tl.load(VM + means, mask=mask, other=0.0), o)
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=mask)
    tl.store(lse_ptrs, lse + q_km * sm_scale, mask=t_ok)


def add_kv_means(o: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k_mean: torch.Tensor,
                 v_mean: torch.Tensor, softmax_scale: float) -> None:
    """longctx.fp8.add_kv_means (o [B, S, Hq, D] unit stride in D, lse [B, S, Hq] float32, q
    [B, S, Hq, D] unit stride in D, any other strides; k_mean, v_mean contiguous [B, Hkv, D]
    float32), in place, in one pass over o and q: the output to its dtype once, as the rule
    rounds it; the LSE's dot product summed in another order (a float32 rounding or two)."""
    B, S, Hq, D = o.shape
    hkv = k_mean.shape[1]
    if B * S * Hq == 0:
        return
    block_t = 32
    _add_kv_means_kernel[(cdiv(B * S, block_t), Hq)](
        o, lse, q, k_mean, v_mean, float(softmax_scale), B * S, S, o.stride(0), o.stride(1),
        o.stride(2), *lse.stride(), q.stride(0), q.stride(1), q.stride(2), hkv,
        GROUP=Hq // hkv, D=D, BLOCK_T=block_t, BLOCK_D=next_power_of_2(D), num_warps=4,
        **FP_FUSION)
