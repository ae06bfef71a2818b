"""Public prefill attention: `attention(q, k, v, ...)` -> O or (O, LSE)."""

from __future__ import annotations

import torch

from longctx.checks import check_attention_inputs, check_offset
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
    check_attention_inputs(q, k, v, softmax_scale)
    check_offset(q_start, "q_start", q.shape[0], q.device)
    check_offset(k_start, "k_start", q.shape[0], q.device)

    o, lse = reference_attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, q_start=q_start, k_start=k_start
    )
    return (o, lse) if return_lse else o
