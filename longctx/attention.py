"""Public prefill attention: `attention(q, k, v, ...)` -> O or (O, LSE)."""

from __future__ import annotations

import torch

from longctx.checks import (
    check_dtype, check_gqa, check_head_dim, check_offset, check_same, check_softmax_scale,
)
from longctx.reference import reference_attention


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    q_start: int | torch.Tensor = 0,
    k_start: int | torch.Tensor = 0,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q over k/v, optionally returning the state's log-sum-exp.

    Args:
        q: [B, Sq, Hq, D] float16/bfloat16/float32 (float64 on CPU).
        k, v: [B, Sk, Hkv, D], same dtype and device as q; Hq % Hkv == 0 (GQA, MQA).
        causal: mask by absolute positions: query q_start+i sees key k_start+j iff
            k_start+j <= q_start+i. Sq != Sk is normal (chunked prefill, ring steps).
        softmax_scale: defaults to 1/sqrt(D).
        q_start, k_start: absolute position of the first query / key; int or [B] int tensor.
        return_lse: also return the LSE.

    Returns:
        o [B, Sq, Hq, D] in q's dtype; with return_lse also lse [B, Hq, Sq] float32, natural log.
        Rows that see no key give O = 0 and LSE = -inf.

    Backend: CPU tensors run the exact torch reference. CUDA tensors currently run the same
    reference too (it materialises the [B, Hq, Sq, Sk] scores); the Triton FlashAttention kernel
    replaces it on CUDA when it lands.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {tuple(t.shape)}")
    check_dtype(q, "q")
    check_same(q, "q", k=k, v=v)
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {q.shape[0]}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k has head_dim {k.shape[-1]} but q has head_dim {q.shape[-1]}")
    check_head_dim(q.shape[-1])
    check_gqa(q.shape[2], k.shape[2])
    check_softmax_scale(softmax_scale)
    check_offset(q_start, "q_start", q.shape[0], q.device)
    check_offset(k_start, "k_start", q.shape[0], q.device)

    o, lse = reference_attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, q_start=q_start, k_start=k_start
    )
    return (o, lse) if return_lse else o
