"""The model's small ops: RMSNorm, rotary embedding, SiLU-and-multiply.

On CUDA each is one fused Triton kernel (longctx.kernels.fused); on the CPU the torch code
below runs, and it is the reference the kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longctx.backend import use_triton_for


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] -> weight * x / sqrt(mean(x^2) + eps): normalised in float32, rounded to x's
    dtype, then scaled by weight [N] (the Llama reference's order)."""
    if use_triton_for(x) and x.stride(-1) == 1:
        from longctx.kernels.fused import rms_norm as kernel

        return kernel(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_tables(max_seq_len: int, head_dim: int, theta: float,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_seq_len, head_dim] float32 for the rotate-half convention (Hugging Face)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
                               / head_dim)
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               pos: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] rotated by the absolute positions pos [B, S] int64 (any strides: an
    expanded [S] or [B] works), with the [max_seq_len, D] float32 tables of `rope_tables`.
    Math in float32, result in x's dtype. May rotate x in place (on CUDA it does)."""
    if use_triton_for(x) and x.stride(-1) == 1:
        from longctx.kernels.fused import rope_

        return rope_(x, cos, sin, pos)
    c, s = cos[pos][:, :, None], sin[pos][:, :, None]  # [B, S, 1, D]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * c + torch.cat((-x2, x1), dim=-1) * s).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, in the inputs' dtype."""
    if use_triton_for(gate) and gate.is_contiguous() and up.is_contiguous():
        from longctx.kernels.fused import silu_mul as kernel

        return kernel(gate, up)
    return F.silu(gate) * up
