"""Small fused Triton kernels for the model's decode step: RMSNorm, rotary embedding of q and k,
SiLU-and-multiply.

At batch 1 a Llama layer's non-matmul ops are dozens of tiny kernels (RMSNorm alone is eight
torch ops); each costs a launch and a ramp, a few µs, against ~0.45 ms of weight reads per
layer. One kernel each keeps the decode step close to the bandwidth limit. The math matches the
torch versions in longctx.ops (which the CPU runs, and which tests compare against).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, W, Y, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
    # One program per row: y = w * (x / sqrt(mean(x^2) + eps)), normalised in fp32, rounded to
    # the input dtype before the weight multiply (as the Llama reference does).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    xn = (x * inv).to(Y.dtype.element_ty)
    w = tl.load(W + offs, mask=mask, other=0.0)
    tl.store(Y + row * stride_y + offs, (w.to(tl.float32) * xn.to(tl.float32)).to(Y.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] (last stride 1), weight [N] -> [..., N] in x's dtype."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    y = torch.empty_like(x2)
    BLOCK = triton.next_power_of_2(N)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, x2.stride(0), y.stride(0), N, eps,
                                     BLOCK=BLOCK, num_warps=min(16, max(1, BLOCK // 512)))
    return y.view(x.shape)


@triton.jit
def _rope_kernel(X, COS, SIN, POS, stride_xb, stride_xs, stride_xh, stride_pb, stride_ps,
                 S, H, stride_t, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    # One program per (token, block of heads): rotate-half RoPE in place,
    # x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, in fp32 (cos/sin tables are fp32).
    t = tl.program_id(0)
    b = (t // S).to(tl.int64)
    s = (t % S).to(tl.int64)
    pos = tl.load(POS + b * stride_pb + s * stride_ps).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(COS + pos * stride_t + offs_d)
    sin = tl.load(SIN + pos * stride_t + offs_d)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (offs_h < H)[:, None]
    base = X + b * stride_xb + s * stride_xs + offs_h[:, None].to(tl.int64) * stride_xh
    x1 = tl.load(base + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(base + offs_d[None, :], (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=mask)
    tl.store(base + HALF + offs_d[None, :], (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=mask)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] (last stride 1) in place by the positions pos [B, S] (any strides,
    e.g. expanded); cos/sin are the [max_seq_len, D] float32 tables. Returns x."""
    B, S, H, D = x.shape
    BLOCK_H = min(triton.next_power_of_2(H), 16)
    _rope_kernel[(B * S, triton.cdiv(H, BLOCK_H))](
        x, cos, sin, pos, x.stride(0), x.stride(1), x.stride(2), pos.stride(0), pos.stride(1),
        S, H, cos.stride(0), HALF=D // 2, BLOCK_H=BLOCK_H, num_warps=2)
    return x


@triton.jit
def _silu_mul_kernel(G, U, Y, N, BLOCK: tl.constexpr):
    # y = silu(g) * u; silu in fp32 rounded to the input dtype first (as F.silu(g) * u does).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + offs, (a * u).to(Y.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for contiguous tensors of one shape and dtype."""
    y = torch.empty_like(gate)
    N = gate.numel()
    BLOCK = 1024
    _silu_mul_kernel[(triton.cdiv(N, BLOCK),)](gate, up, y, N, BLOCK=BLOCK, num_warps=4)
    return y
