"""Public decode attention: one query token per sequence against a (possibly paged) KV cache."""

from __future__ import annotations

import torch

from longctx.backend import use_triton_for
from longctx.checks import (
    check_dtype, check_flag, check_gqa, check_head_dim, check_optional_int, check_same,
    check_softmax_scale, check_tensor,
)
from longctx.fp8 import (
    FP8, check_key_major, check_kv_means, check_kv_scales, check_page_size, is_key_major,
)
from longctx.reference import reference_attention


def _check_decode_args(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, return_lse,
                       k_scale=None, v_scale=None, k_mean=None, v_mean=None) -> bool:
    """`decode`'s input checks; returns whether smoothing means are given."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("cache_seqlens", cache_seqlens), ("block_table", block_table)):
        if t is not None or name in ("q", "k_cache", "v_cache"):
            check_tensor(name, t)
    check_optional_int("num_splits", num_splits, 1)
    check_flag("return_lse", return_lse)
    if q.dim() == 4 and q.shape[1] != 1:
        raise ValueError(f"q must be [B, Hq, D] or [B, 1, Hq, D]; got seq dim {q.shape[1]} != 1")
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [B, Hq, D] or [B, 1, Hq, D], got shape {tuple(q.shape)}")
    check_dtype(q, "q")
    if k_cache.dtype == FP8:  # q keeps its dtype (the kernel widens the fp8 tiles)
        check_same(k_cache, "k_cache", v_cache=v_cache)
        if k_cache.device != q.device:
            raise ValueError(f"k_cache is on {k_cache.device} but q is on {q.device}")
    else:
        check_same(q, "q", k_cache=k_cache, v_cache=v_cache)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [B, S_max, Hkv, D] (or paged [num_pages, "
            f"page_size, Hkv, D]), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    B, Hq, D = q.shape[0], q.shape[-2], q.shape[-1]
    if k_cache.shape[-1] != D:
        raise ValueError(f"k_cache has head_dim {k_cache.shape[-1]} but q has head_dim {D}")
    check_head_dim(D)
    check_gqa(Hq, k_cache.shape[2], "k_cache")
    key_major = is_key_major(v_cache)  # an fp8 V stored keys-contiguous (longctx.fp8)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1 and not (t is v_cache and key_major):
            raise ValueError(f"{name} must have unit stride in its last (head_dim) dim")
    if key_major:
        check_key_major(v_cache, "v_cache")  # paged: each page's rows (page_size keys)
    if block_table is not None:
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B:
            raise ValueError(
                f"block_table must be an int32 tensor [B={B}, max_pages], got "
                f"{block_table.dtype} {tuple(block_table.shape)}"
            )
        if block_table.stride(1) != 1 and block_table.shape[1] > 1:
            raise ValueError(f"block_table must have unit stride in its last (pages) dim, got "
                             f"strides {block_table.stride()}")
        if block_table.device != q.device:
            raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}")
        check_page_size(k_cache.shape[1], "k_cache")
    elif k_cache.shape[0] != B:
        raise ValueError(f"k_cache has batch {k_cache.shape[0]} but q has batch {B}")
    if cache_seqlens is not None:
        if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (B,):
            raise ValueError(
                f"cache_seqlens must be an int32 tensor of shape [{B}], got "
                f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}"
            )
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {q.device}")
    fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale, q.device)
    return check_kv_means(k_mean, v_mean, fp8, B, k_cache, q.device)


def _check_decode_values(q, k_cache, cache_seqlens, block_table, capacity):
    """Lengths within capacity and page ids in range, for CPU tensors; without cache_seqlens
    every sequence is `capacity` long, so every page id of block_table is read. On CUDA reading
    the values would cost a host sync per call, so the kernel checks them instead and writes NaN
    for a sequence with an invalid length or page id (loud, never silently wrong)."""
    if q.is_cuda:
        return
    if cache_seqlens is None:
        lens = torch.full((q.shape[0],), capacity, dtype=torch.int64)
    else:
        lens = cache_seqlens.long()
    bad_len = (lens < 0) | (lens > capacity)
    if bad_len.any():
        b = int(bad_len.nonzero()[0, 0])
        raise ValueError(
            f"cache_seqlens[{b}] = {int(lens[b])} is outside the cache capacity [0, {capacity}]"
        )
    if block_table is not None:
        page = k_cache.shape[1]
        used = torch.arange(block_table.shape[1])[None] * page < lens[:, None]
        ids = block_table.long()
        if (used & ((ids < 0) | (ids >= k_cache.shape[0]))).any():
            raise ValueError(
                f"block_table holds page ids outside [0, {k_cache.shape[0]}) within the sequences' "
                f"lengths (cache_seqlens, or without it the full capacity {capacity})"
            )


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Paged cache [num_pages, page_size, Hkv, D] + block_table [B, P] -> [B, P*page_size, Hkv, D]
    (its scales [num_pages, page_size, Hkv] -> [B, P*page_size, Hkv] alike).

    Entries past a sequence's length may hold any id; they are clamped (and masked later).
    """
    ids = block_table.long().clamp(0, cache.shape[0] - 1)
    g = cache[ids]  # [B, P, page_size, Hkv, D]
    return g.reshape(g.shape[0], -1, *cache.shape[2:])


# longctx.kernels.launch and .decode, imported on first use (CPU-only use never imports Triton).
_kl = _kd = None


def _kernels():
    global _kl, _kd
    if _kl is None:
        from longctx.kernels import decode as kd, launch as kl

        _kl, _kd = kl, kd
    return _kl


# Validated plans by input signature: (current device, then device index, dtype, shape, strides
# of q, k_cache, v_cache, cache_seqlens, block_table, then softmax_scale, num_splits, return_lse
# and whether PDL is allowed). Every check of `_check_decode_args` and everything DecodePlan
# computes is a function of these (no values: on CUDA lengths and page ids are checked by the
# kernel), so a hit needs neither.
_PLANS: dict = {}


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
    v_mean: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode attention (Flash-Decoding): each sequence's one query token over its KV cache.

    Args:
        q: [B, Hq, D] or [B, 1, Hq, D], float16/bfloat16/float32 (float64 on CPU); D
            (head_dim) a multiple of 8 in [16, 256].
        k_cache, v_cache: contiguous [B, S_max, Hkv, D], or paged [num_pages, page_size, Hkv, D]
            (page_size a power of two >= 16) with `block_table`; same dtype/device as q;
            Hq % Hkv == 0. Or an fp8 cache: float8_e4m3fn (both), with k_scale / v_scale; an
            fp8 v_cache may be key-major (`longctx.fp8.key_major_v`: keys contiguous, 1.15-1.33x
            faster on an H200; paged, within each page: `key_major_v(..., paged=True)`), its
            slots from each length to the next multiple of 16 finite (zeros unless written).
        cache_seqlens: [B] int32, valid length of each sequence (0 allowed). Default: the full
            capacity (S_max, or max_pages * page_size when paged).
        block_table: [B, max_pages] int32 page ids, in any order; pages may be shared.
        softmax_scale: defaults to 1/sqrt(D).
        num_splits: KV splits per sequence on CUDA; None chooses from the SM count, batch, heads
            and capacity. Any value >= 1 gives the same result up to rounding.
        return_lse: also return the LSE.
        k_scale, v_scale: an fp8 cache's scales, float32, on q's device, shaped like the cache
            without head_dim ([B, S_max, Hkv], paged [num_pages, page_size, Hkv]; any strides,
            e.g. longctx.fp8.head_major, the model's): key j of KV head h is
            k_cache[.., j, h, :] * k_scale[.., j, h], value likewise (longctx.fp8: one scale
            per token and KV head). Required with an fp8 cache, refused
            without one. The kernel widens the fp8 tiles to float16 (float32 for a float32 q)
            and applies the scales per key in registers.
        k_mean, v_mean: a smoothed fp8 cache's means (both or neither): float32 [B, Hkv, D],
            contiguous, on q's device; key j of KV head h of sequence b is then
            k_cache[.., j, h, :] * k_scale[.., j, h] + k_mean[b, h], value likewise
            (longctx.fp8: the model's fp8 cache holds K and V less their first prefill chunk's
            means). The kernel adds them to each split's state (LSE and output), not per key.

    Returns:
        o with q's shape and dtype; with return_lse also lse float32 (float64 for a float64 q),
        natural log, shaped like o without head_dim ([B, Hq], or [B, 1, Hq] for a 4-D q), so
        (o, lse) go to `merge_states` / `merge_into` as they are. A sequence of length 0 gives
        o = 0 and lse = -inf.

    Lengths beyond the capacity and out-of-range page ids raise ValueError for CPU tensors; on
    CUDA (no host sync: CUDA-graph capturable) the kernel writes NaN for such a sequence.

    On CUDA a call with an input signature seen before (devices, dtypes, shapes and strides of
    the tensors, and the other arguments) skips validation and launches the kernels directly
    (longctx.kernels.launch); `LONGCTX_FAST_LAUNCH=0` or `fast_launch(False)` turns that off.
    """
    # CUDA tensors (CPU ones only in tests, which patch longctx.kernels.launch; their value
    # checks then do not run, as on CUDA).
    if use_triton_for(q) and (kl := _kl or _kernels()).fast_launch_active():
        dev = kl.current_device()
        try:
            key = (dev, q.get_device(), q.dtype, q.shape, q.stride(),
                   k_cache.get_device(), k_cache.dtype, k_cache.shape, k_cache.stride(),
                   v_cache.get_device(), v_cache.dtype, v_cache.shape, v_cache.stride(),
                   kl.signature(cache_seqlens), kl.signature(block_table), softmax_scale,
                   num_splits, return_lse, kl.pdl_allowed(), kl.signature(k_scale),
                   kl.signature(v_scale), kl.signature(k_mean), kl.signature(v_mean))
            plan = _PLANS.get(key)
        except (AttributeError, TypeError):  # not tensors / unhashable: validation says what
            key = plan = None
        if plan is None:
            means = _check_decode_args(q, k_cache, v_cache, cache_seqlens, block_table,
                                       num_splits, return_lse, k_scale, v_scale, k_mean, v_mean)
            check_softmax_scale(softmax_scale)
            scale = softmax_scale if softmax_scale is not None else q.shape[-1]**-0.5
            plan = _kd.DecodePlan(q, k_cache, v_cache, cache_seqlens, block_table, scale,
                                 num_splits, return_lse, k_scale=k_scale, v_scale=v_scale,
                                 means=means)
            if key is not None:
                kl.remember(_PLANS, key, plan)
        o, lse = plan(q, k_cache, v_cache, cache_seqlens, block_table, dev, k_scale, v_scale,
                      k_mean, v_mean)
        return (o, lse) if return_lse else o

    means = _check_decode_args(q, k_cache, v_cache, cache_seqlens, block_table, num_splits,
                               return_lse, k_scale, v_scale, k_mean, v_mean)
    check_softmax_scale(softmax_scale)
    q3 = q.reshape(q.shape[0], q.shape[-2], q.shape[-1]) if q.dim() == 4 else q
    B, _, D = q3.shape
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    _check_decode_values(q, k_cache, cache_seqlens, block_table, capacity)
    scale = softmax_scale if softmax_scale is not None else D**-0.5

    if use_triton_for(q):
        # Triton's launch path (the interpreter on CPU; on CUDA with fast launches off).
        _kernels()
        o, lse = _kd.DecodePlan(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits,
                                return_lse, k_scale=k_scale, v_scale=v_scale, means=means)(
            q, k_cache, v_cache, cache_seqlens, block_table, None, k_scale, v_scale, k_mean,
            v_mean)
        return (o, lse) if return_lse else o
    k = gather_pages(k_cache, block_table) if paged else k_cache
    v = gather_pages(v_cache, block_table) if paged else v_cache
    if k_scale is not None:
        k_scale = gather_pages(k_scale, block_table) if paged else k_scale
        v_scale = gather_pages(v_scale, block_table) if paged else v_scale
    o, lse = reference_attention(q3[:, None], k, v, softmax_scale=scale, seqlens_k=cache_seqlens,
                                 k_scale=k_scale, v_scale=v_scale, k_mean=k_mean, v_mean=v_mean)
    # reference_attention's [B, 1, Hq(, D)] is a 4-D q's own shape; a 3-D q drops the 1
    if q.dim() == 3:
        o, lse = o[:, 0], lse[:, 0]
    return (o, lse) if return_lse else o
