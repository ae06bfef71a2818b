"""The model's small ops: batch-1 linear (plain, or fused with SiLU-and-multiply), RMSNorm,
rotary embedding, SiLU-and-multiply, KV store, and a decode step's rotary embedding and KV store
together.

On CUDA each is one fused Triton kernel (longctx.kernels.fused); on the CPU the torch code
below runs, and it is the reference the kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longctx.backend import use_triton_for
from longctx.fp8 import add_kv_means as fp8_add_kv_means
from longctx.fp8 import dequantize_kv as fp8_dequantize_kv
from longctx.fp8 import is_key_major, quantize_kv
from longctx.rope import RopeScaling, attention_factor, inv_freq


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear(x, weight) runs the Triton GEMV: one half-precision row on CUDA."""
    return (use_triton_for(x) and x.numel() == x.shape[-1]
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and weight.stride(-1) == 1)


def skinny_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear(x, weight) runs the Triton skinny GEMM: 2-16 half-precision rows on CUDA
    (a decode step at batch 2-16)."""
    from longctx.kernels.gemv import SKINNY_MAX_ROWS

    return (use_triton_for(x) and 2 <= x.numel() // x.shape[-1] <= SKINNY_MAX_ROWS
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and weight.stride(-1) == 1 and x.stride(-1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]), in x's dtype.

    A single half-precision row on CUDA (a batch-1 decode step) runs longctx's Triton GEMV
    (kernels/gemv.py), a plain stream of the weights, which adds the bias to its float32 sums
    before the one rounding (as cuBLAS's bias epilogue does); 2-16 rows (batch 2-16) its skinny
    GEMM; anything else runs torch's linear.
    """
    bias_ok = bias is None or (bias.dtype == x.dtype and bias.stride(-1) == 1)
    if gemv_applies(x, weight) and bias_ok:
        from longctx.kernels.gemv import gemv

        return gemv(x, weight, bias=bias)
    if skinny_applies(x, weight) and bias_ok:
        from longctx.kernels.gemv import skinny_gemm

        return skinny_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_mul(linear(x, weight)): weight [2I, K] stacks the gate rows over the up rows;
    returns silu(x @ gate^T) * (x @ up^T) [..., I] in x's dtype. For a single half-precision
    row on CUDA one GEMV computes it, the activation in its epilogue (same rounding)."""
    if gemv_applies(x, weight):
        from longctx.kernels.gemv import gemv

        return gemv(x, weight, gated=True)
    return silu_mul(linear(x, weight))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             add: torch.Tensor | None = None):
    """x [..., N] -> weight * x / sqrt(mean(x^2) + eps): normalised in float32, rounded to x's
    dtype, then scaled by weight [N] (the Llama reference's order).

    With `add` (x's shape and dtype): the residual add fused in front, returning
    (x + add, rms_norm(x + add)) -- one kernel on CUDA instead of two.
    """
    if use_triton_for(x) and x.stride(-1) == 1 and (add is None or add.stride(-1) == 1):
        from longctx.kernels.fused import rms_norm as kernel

        return kernel(x, weight, eps, add)
    if add is not None:
        x = x + add
        return x, rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_tables(max_seq_len: int, head_dim: int, theta: float, device: torch.device,
                scaling: RopeScaling | None = None,
                prompt_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_seq_len, head_dim] float32 for the rotate-half convention (Hugging Face's):
    row p rotates position p, computed as transformers' rotary embedding computes it.

    scaling (longctx.rope.RopeScaling; None: plain RoPE) sets the frequencies, and its attention
    factor (YaRN) multiplies cos and sin, as in transformers. Dynamic NTK scaling depends on the
    prompt: rows [0, prompt_len) rotate as one call over a prompt of prompt_len positions, later
    rows as decoded tokens (longctx.rope explains the rule); other types ignore prompt_len.
    """
    pos = torch.arange(max_seq_len, dtype=torch.float32, device=device)
    freqs = pos[:, None] * inv_freq(head_dim, theta, scaling, device=device)  # [S, D/2]
    if scaling is not None and scaling.rope_type == "dynamic":
        orig = scaling.original_max_position_embeddings
        lens = torch.arange(orig + 1, max_seq_len + 1, dtype=torch.int64, device=device)
        # Position p >= orig decoded alone: the frequencies of length p + 1.
        freqs[orig:] = pos[orig:, None] * inv_freq(head_dim, theta, scaling, lens)
        if prompt_len > orig:
            n = min(prompt_len, max_seq_len)
            whole = torch.tensor([prompt_len], dtype=torch.int64, device=device)
            freqs[:n] = pos[:n, None] * inv_freq(head_dim, theta, scaling, whole)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor(scaling) != 1.0:  # in place: no third and fourth table
        cos.mul_(attention_factor(scaling))
        sin.mul_(attention_factor(scaling))
    return cos, sin


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          pos: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] in place by the absolute positions pos [B, S] int64 (any strides:
    an expanded [S] or [B] works), with the [max_seq_len, D] float32 tables of `rope_tables`.
    x may be a strided view (e.g. the q and k heads of a fused projection) with unit stride in
    D. Math in float32, result in x's dtype. Returns x."""
    if use_triton_for(x) and x.stride(-1) == 1:
        from longctx.kernels.fused import rope_ as kernel

        return kernel(x, cos, sin, pos)
    c, s = cos[pos][:, :, None], sin[pos][:, :, None]  # [B, S, 1, D]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return x.copy_(xf * c + torch.cat((-x2, x1), dim=-1) * s)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate, then up: a fused projection's output) -> silu(gate) * up
    [..., I], in the input's dtype."""
    if use_triton_for(gate_up) and gate_up.is_contiguous():
        from longctx.kernels.fused import silu_mul as kernel

        return kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, k_mean: torch.Tensor | None = None,
             v_mean: torch.Tensor | None = None) -> None:
    """k_cache[b, slot[b]] = k[b] and v_cache[b, slot[b]] = v[b] for every sequence b.

    k_cache/v_cache [B, S_max, Hkv, D] (contiguous for the kernel; any strides otherwise);
    k/v [B, Hkv, D] (unit stride in D; e.g. views into a fused projection); slot [B] int64. On
    CUDA one kernel writes both (a decode step's cache update at batch 1 is two tiny index_put
    kernels otherwise); a slot outside [0, S_max) is not written there (no host check), and the
    decode that follows writes NaN for it. An fp8 cache (float8_e4m3fn, with k_scale / v_scale
    [B, S_max, Hkv] float32; its V may be key-major, longctx.fp8) stores
    longctx.fp8.quantize_kv of k and v and their scales (torch code: the model's decode step
    writes fp8 through rope_store_kv's kernel), less k_mean / v_mean [B, Hkv, D] float32 if
    given (longctx.fp8's smoothing).
    """
    if k_scale is None and use_triton_for(k) and k.stride(-1) == 1 and v.stride(-1) == 1 \
            and k_cache.is_contiguous() and v_cache.is_contiguous():
        from longctx.kernels.fused import store_kv as kernel

        kernel(k_cache, v_cache, k, v, slot)
        return
    b = torch.arange(k.shape[0], device=k.device)
    if k_scale is not None:
        (k, k_scale[b, slot]), (v, v_scale[b, slot]) = (quantize_kv(k, k_mean),
                                                        quantize_kv(v, v_mean))
        # As bytes: index_put is not implemented for float8 on every device. (A dtype view of
        # the same element size keeps the strides: a key-major V is written in place.)
        k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
    k_cache[b, slot] = k
    v_cache[b, slot] = v


def store_fp8(dst: torch.Tensor, dst_scale: torch.Tensor, x: torch.Tensor,
              mean: torch.Tensor | None = None) -> None:
    """Write x [B, S, H, D] into an fp8 cache: dst, dst_scale = longctx.fp8.quantize_kv(x), dst
    [B, S, H, D] float8_e4m3fn (any strides: e.g. a key-major V, longctx.fp8) and dst_scale
    [B, S, H] float32 being views of the cache and its scales (a prefill chunk's positions);
    mean: None or contiguous [B, H, D] float32, subtracted first (longctx.fp8's smoothing). On
    CUDA one kernel reads x once and writes both."""
    if use_triton_for(x) and x.stride(-1) == 1:
        from longctx.kernels.fused import store_fp8 as kernel

        kernel(dst, dst_scale, x, mean)
        return
    x_fp8, scale = quantize_kv(x, None if mean is None else mean[:, None])
    dst.copy_(x_fp8)
    dst_scale.copy_(scale)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                  mean: torch.Tensor | None = None) -> torch.Tensor:
    """longctx.fp8.dequantize_kv(x, scale, dtype, mean[:, None]): x [B, S, H, D]
    float8_e4m3fn (any strides), scale [B, S, H] float32, mean None or contiguous [B, H, D]
    float32 (smoothing) -> contiguous [B, S, H, D] in dtype. On CUDA one kernel, bit for bit
    the same, with no float32 temporaries."""
    if use_triton_for(x) and dtype != torch.float64:
        from longctx.kernels.fused import dequantize_fp8

        return dequantize_fp8(x, scale, torch.empty(x.shape, dtype=dtype, device=x.device), mean)
    return fp8_dequantize_kv(x, scale, dtype, None if mean is None else mean[:, None])


def add_kv_means(o: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k_mean: torch.Tensor,
                 v_mean: torch.Tensor, softmax_scale: float) -> None:
    """longctx.fp8.add_kv_means(o, lse, q, k_mean, v_mean, softmax_scale), in place: a smoothed
    fp8 history's means added to an attention state (o [B, S, Hq, D], lse [B, S, Hq] float32).
    On CUDA one kernel reads o and q once (the torch rule makes float32 copies of both)."""
    if use_triton_for(o) and o.stride(-1) == 1 and q.stride(-1) == 1:
        from longctx.kernels.fused import add_kv_means as kernel

        kernel(o, lse, q, k_mean, v_mean, softmax_scale)
        return
    fp8_add_kv_means(o, lse, q, k_mean, v_mean, softmax_scale)


def _rope_store_kernel_takes(k_cache: torch.Tensor, v_cache: torch.Tensor,
                             k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Whether kernels/fused.py's rope_store_kv writes these caches: contiguous ones, or an fp8
    cache of any layout with a unit head_dim stride in K (V's may be key-major) and its two
    scales of one layout (the kernel takes one set of scale strides)."""
    if k_scale is None:
        return k_cache.is_contiguous() and v_cache.is_contiguous()
    return (k_cache.stride(-1) == 1 and (v_cache.stride(-1) == 1 or is_key_major(v_cache))
            and k_scale.stride() == v_scale.stride())


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, k_mean: torch.Tensor | None = None,
                  v_mean: torch.Tensor | None = None) -> None:
    """A decode step's RoPE and KV-cache store: `rope_` of q [B, Hq, D] and k [B, Hkv, D] in
    place at the positions pos [B] int64 (one token per sequence), then `store_kv` of k and
    v [B, Hkv, D] at slot [B] int64 of k_cache/v_cache [B, S_max, Hkv, D].

    The same math and the same bits as those two (float32 tables cos/sin [max_seq_len, D] of
    `rope_tables`; a slot outside [0, S_max) is not written on CUDA). q/k/v may be strided
    views (the heads of a fused projection) with unit stride in D. On CUDA one kernel does it
    all (rope_ and store_kv are a launch each) for contiguous caches; on the CPU it is rope_
    and store_kv. An fp8 cache takes k_scale / v_scale [B, S_max, Hkv] float32 and stores the
    rotated k and v quantized (longctx.fp8.quantize_kv) with their scales, in the same kernel,
    for any strides (the model's: k_cache and the scales longctx.fp8.head_major, v_cache
    key-major, longctx.fp8.key_major_v) but for a unit stride in k_cache's head_dim and the
    two scales' strides alike. k_mean / v_mean [B, Hkv, D] float32 (contiguous): an fp8
    cache smoothed by them (longctx.fp8), subtracted from the rotated k and from v.
    """
    B, hkv, D = k.shape
    if q.dim() != 3 or q.shape[0] != B or q.shape[2] != D or v.shape != k.shape:
        raise ValueError(f"q must be [B, Hq, D] and v [B, Hkv, D] like k {tuple(k.shape)}, got "
                         f"q {tuple(q.shape)} and v {tuple(v.shape)}")
    if k_cache.shape[0] != B or k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must be [{B}, S_max, {hkv}, {D}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if pos.shape != (B,) or slot.shape != (B,):
        raise ValueError(f"pos and slot must be [{B}], got {tuple(pos.shape)} and "
                         f"{tuple(slot.shape)}")
    if use_triton_for(q) and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 \
            and _rope_store_kernel_takes(k_cache, v_cache, k_scale, v_scale):
        from longctx.kernels.fused import rope_store_kv as kernel

        kernel(q, k, v, cos, sin, pos, k_cache, v_cache, slot, k_scale, v_scale, k_mean, v_mean)
        return
    pos = pos[:, None]
    rope_(q[:, None], cos, sin, pos)
    rope_(k[:, None], cos, sin, pos)
    store_kv(k_cache, v_cache, k, v, slot, k_scale, v_scale, k_mean, v_mean)
