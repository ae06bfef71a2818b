"""Exact reference attention: the oracle of every test and the CPU backend of the public API.

Materialises the [B, Hq, Sq, Sk] scores, so it is for CPU runs and tests, not long sequences on
a GPU. Repeats KV heads for GQA (the kernels never do).
"""

from __future__ import annotations

import torch
from einops import rearrange, repeat

from longctx.fp8 import dequantize_kv


def _per_batch(x: int | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """An int or a [B] tensor of offsets/lengths -> an int64 [B] tensor on `device`."""
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.int64).reshape(batch)
    return torch.full((batch,), int(x), dtype=torch.int64, device=device)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    q_start: int | torch.Tensor = 0,
    k_start: int | torch.Tensor = 0,
    seqlens_k: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
    v_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention returning the state (O, LSE).

    Args:
        q: [B, Sq, Hq, D].
        k, v: [B, Sk, Hkv, D] with Hq % Hkv == 0 (GQA: query head h reads KV head h // (Hq/Hkv)).
        causal: query at absolute position q_start+i sees key at k_start+j iff
            k_start+j <= q_start+i.
        softmax_scale: defaults to 1/sqrt(D).
        q_start, k_start: absolute position of the first query / key, an int or a [B] tensor.
        seqlens_k: optional [B] valid key count per sequence; keys j >= seqlens_k[b] are masked.
        compute_dtype: math dtype; default float32, or float64 when q is float64. Pass
            torch.float64 for an exact oracle. A half dtype (float16/bfloat16) gives the plain
            PyTorch implementation in that dtype: matmuls in it, softmax in float32 (the bar
            the kernels' error is held to).
        k_scale, v_scale: for an fp8 cache (k, v float8_e4m3fn): float32 [B, Sk, Hkv] scales;
            k and v are dequantized first (longctx.fp8.dequantize_kv, in float32, or float64
            for float64 q), then attended as above.
        k_mean, v_mean: with k_scale / v_scale, a smoothed cache's means [B, Hkv, D] float32,
            added as k and v are dequantized (longctx.fp8).

    Returns:
        o [B, Sq, Hq, D] in q's dtype (compute_dtype if that is float64), and
        lse [B, Sq, Hq] (o's shape without head_dim, as everywhere in longctx) natural log,
        float32 (float64 if computed in float64).
        Rows with no visible key give O = 0 and LSE = -inf. Keys that no query sees are never
        read into o (their values may be anything, NaN included).
    """
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    dt = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    if k_scale is not None:
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32
        km, vm = (None, None) if k_mean is None else (k_mean[:, None], v_mean[:, None])
        k, v = dequantize_kv(k, k_scale, wide, km), dequantize_kv(v, v_scale, wide, vm)
    sm_dt = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt  # softmax dtype
    scale = softmax_scale if softmax_scale is not None else D**-0.5
    g = Hq // Hkv
    qf = rearrange(q.to(dt), "b s h d -> b h s d")
    kf = repeat(k.to(dt), "b s h d -> b (h g) s d", g=g)
    vf = repeat(v.to(dt), "b s h d -> b (h g) s d", g=g)
    scores = (torch.matmul(qf, kf.transpose(-1, -2)) * scale).to(sm_dt)  # [B, Hq, Sq, Sk]

    visible = torch.ones(B, Sq, Sk, dtype=torch.bool, device=q.device)
    kpos = torch.arange(Sk, device=q.device)
    if seqlens_k is not None:
        visible &= kpos[None, None, :] < _per_batch(seqlens_k, B, q.device)[:, None, None]
    if causal:
        qabs = _per_batch(q_start, B, q.device)[:, None] + torch.arange(Sq, device=q.device)
        kabs = _per_batch(k_start, B, q.device)[:, None] + kpos
        visible &= kabs[:, None, :] <= qabs[:, :, None]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    # A key no query of the call sees (past seqlens_k, or past the last query under causal: a
    # cache buffer's unwritten tail) must not reach o even if its v is NaN or inf (0 * NaN).
    if causal or seqlens_k is not None:
        seen = visible.any(dim=1)[:, None, :, None]  # [B, 1, Sk, 1]
        vf = torch.where(seen, vf, torch.zeros((), dtype=dt, device=vf.device))

    lse = torch.logsumexp(scores, dim=-1)  # -inf for rows that see nothing
    lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(scores - lse_safe[..., None])  # exactly 0 on masked keys
    o = rearrange(torch.matmul(p.to(dt), vf), "b h s d -> b s h d")
    out_dtype = dt if dt == torch.float64 else q.dtype
    lse_dtype = torch.float64 if dt == torch.float64 else torch.float32
    return o.to(out_dtype), rearrange(lse, "b h s -> b s h").to(lse_dtype).contiguous()
