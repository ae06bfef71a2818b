"""Public prefill attention: `attention(q, k, v, ...)` -> O or (O, LSE)."""

from __future__ import annotations

import torch

from longctx.backend import use_triton_for
from longctx.checks import (
    check_accumulator, check_attention_inputs, check_flag, check_not_fp8, check_offset,
    check_optional_int, check_tensor,
)
from longctx.fp8 import FP8, check_kv_means
from longctx.merge import check_lse, merge_into
from longctx.ops import add_kv_means
from longctx.reference import reference_attention


def _check_cu_seqlens(cu: torch.Tensor, name: str, total: int, device: torch.device,
                      max_seqlen: int | None) -> None:
    check_tensor(name, cu)
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1-D int32 tensor [batch + 1], got {cu.dtype} {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    if not cu.is_cuda:  # values are free to read on CPU; on CUDA that would be a host sync
        if int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(
                f"{name} must start at 0, be non-decreasing and end at the packed length {total}; "
                f"got {cu.tolist()}"
            )
        longest = int((cu[1:] - cu[:-1]).max())
        if max_seqlen is not None and max_seqlen < longest:
            arg = name.replace("cu_seqlens", "max_seqlen")
            raise ValueError(f"{arg} ({max_seqlen}) is less than the longest sequence in {name} "
                             f"({longest}): it sizes the kernel's grid")


# longctx.kernels.launch and .prefill, imported on first use (CPU-only use never imports Triton).
_kl = _kp = None


def _kernels():
    global _kl, _kp
    if _kl is None:
        from longctx.kernels import launch as kl, prefill as kp

        _kl, _kp = kl, kp
    return _kl


# Validated plans by input signature: (current device, `signature` of every tensor / offset argument
# (cu_seqlens' only in varlen mode), causal, softmax_scale, max_seqlen_q/k, return_lse). Every
# shape check of `attention` and everything PrefillPlan computes is a function of these (on CUDA
# no values are read).
_PLANS: dict = {}
_MERGE_PLANS: dict = {}


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    q_start: int | torch.Tensor = 0,
    k_start: int | torch.Tensor = 0,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    return_lse: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
    v_mean: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q over k/v, optionally returning the state's log-sum-exp.

    Args:
        q: [B, Sq, Hq, D] float16/bfloat16/float32 (float64 on CPU); varlen: [total_q, Hq, D];
            D (head_dim) a multiple of 8 in [16, 256].
        k, v: [B, Sk, Hkv, D] (varlen: [total_k, Hkv, D]), same dtype and device as q;
            Hq % Hkv == 0 (GQA, MQA: KV heads are never repeated in memory).
        causal: mask by absolute positions: query q_start+i sees key k_start+j iff
            k_start+j <= q_start+i. Sq != Sk is normal (chunked prefill, ring steps).
        softmax_scale: defaults to 1/sqrt(D).
        q_start, k_start: absolute position of the first query / key of each sequence; an int
            or a [B] int32/int64 tensor. Only q_start - k_start matters (negative values too).
        cu_seqlens_q, cu_seqlens_k: varlen mode: [B + 1] int32 cumulative lengths of the packed
            sequences (both or neither).
        max_seqlen_q, max_seqlen_k: varlen: the longest sequence (sizes the CUDA grid). If
            omitted they are read from cu_seqlens, which costs a host sync on CUDA.
        return_lse: also return the LSE.
        k_scale, v_scale: dense k/v from an fp8 cache (both float8_e4m3fn, q in its own dtype):
            their float32 scales [B, Sk, Hkv] (any strides), key j of KV head h being
            k[:, j, h] * k_scale[:, j, h] (longctx.fp8); required with fp8 k/v, refused
            otherwise. On CUDA head_dim must then be a multiple of 16. v may then be stored
            key-major (longctx.fp8.key_major_v), k and the scales head-major
            (longctx.fp8.head_major), as the model's fp8 cache is. On an H100 / H200 past a
            measured size, k / v are dequantized to q's dtype a block of keys at a time (their
            values rounded to q's dtype, as a plain computation in that dtype rounds them;
            longctx.kernels.prefill `fp8_blocks_apply`).
        k_mean, v_mean: with k_scale / v_scale, a smoothed fp8 cache's means (both or neither):
            float32 [B, Hkv, D], contiguous; key j of KV head h of sequence b is then
            k[b, j, h] * k_scale[b, j, h] + k_mean[b, h], value likewise (longctx.fp8). On CUDA
            the kernel attends the stored values and the means are added to its state after
            (`longctx.ops.add_kv_means`: one pass over o and q).

    Returns:
        o shaped like q, in q's dtype; with return_lse also the LSE, float32 natural log (float64
        for a float64 q), shaped like o without head_dim: [B, Sq, Hq] (varlen: [total_q, Hq]), the
        layout `merge_states` / `merge_into` take. Rows that see no key give O = 0 and LSE = -inf.

    Values: every key position of k / v that some query of the call sees must be finite. A NaN or
    inf there turns into NaN rows that do not see it too (0 x NaN): in the kernels the rows that
    share its key tile (FlashAttention does the same), in the CPU reference every row of its
    sequence that reads its KV head. Keys no query sees (past each sequence's keys, or beyond the
    last query under causal) may hold anything on CPU; on CUDA pass k / v only up to the keys the
    call uses (a cache buffer sliced at its written length). On CUDA, cu_seqlens and max_seqlen are
    trusted, as FlashAttention trusts them (reading them would cost a host sync): a max_seqlen_q
    below the longest sequence leaves the rows past it unwritten.

    Backend: CUDA tensors run the Triton FlashAttention kernel (longctx.kernels.prefill; on
    Hopper GPUs its Gluon fast path where that applies); CPU tensors the exact torch reference.
    On CUDA a call with an input signature seen before skips validation and launches the kernel
    directly (longctx.kernels.launch).
    """
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if (use_triton_for(q) and (kl := _kl or _kernels()).fast_launch_active()
            and (not varlen or (max_seqlen_q is not None and max_seqlen_k is not None))):
        dev = kl.current_device()
        try:
            # `signature` of every argument, q's, k's and v's inline (a third of the key's time).
            sig = kl.signature
            key = (dev, q.get_device(), q.dtype, q.shape, q.stride(),
                   k.get_device(), k.dtype, k.shape, k.stride(),
                   v.get_device(), v.dtype, v.shape, v.stride(), causal, softmax_scale,
                   sig(q_start), sig(k_start), varlen and (sig(cu_seqlens_q), sig(cu_seqlens_k)),
                   max_seqlen_q, max_seqlen_k, return_lse, sig(k_scale), sig(v_scale),
                   sig(k_mean), sig(v_mean))
            plan = _PLANS.get(key)
        except (AttributeError, TypeError):  # not tensors / unhashable: validation says what
            key = plan = None
        if plan is None:
            scale = _check_attention(q, k, v, causal, softmax_scale, q_start, k_start,
                                     cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     return_lse, varlen, k_scale, v_scale, k_mean, v_mean)
            _kp.check_prefill_args(q, k, v, q_start, k_start, cu_seqlens_q, max_seqlen_q,
                                   max_seqlen_k, None, k_scale)
            plan = _kp.PrefillPlan(q, k, v, softmax_scale=scale, causal=causal, q_start=q_start,
                                   k_start=k_start, cu_seqlens_q=cu_seqlens_q,
                                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                   max_seqlen_k=max_seqlen_k, accumulate=None, config=None,
                                   return_lse=return_lse or k_mean is not None,
                                   k_scale=k_scale, v_scale=v_scale)
            if key is not None:
                kl.remember(_PLANS, key, plan)
        o, lse = plan(q, k, v, q_start, k_start, cu_seqlens_q, cu_seqlens_k, None, dev,
                      k_scale, v_scale)
        if k_mean is not None:
            add_kv_means(o, lse, q, k_mean, v_mean,
                         softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5)
        return (o, lse) if return_lse else o

    scale = _check_attention(q, k, v, causal, softmax_scale, q_start, k_start, cu_seqlens_q,
                             cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_lse, varlen,
                             k_scale, v_scale, k_mean, v_mean)
    if use_triton_for(q):
        _kernels()
        if varlen and max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        if varlen and max_seqlen_k is None:
            max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
        o, lse = _kp.flash_attention_fwd(
            q, k, v, softmax_scale=scale, causal=causal, q_start=q_start, k_start=k_start,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, k_scale=k_scale, v_scale=v_scale,
        )
        if k_mean is not None:
            add_kv_means(o, lse, q, k_mean, v_mean, scale)
    elif varlen:
        o, lse = _reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale,
                                   q_start, k_start)
    else:
        o, lse = reference_attention(q, k, v, causal=causal, softmax_scale=scale,
                                     q_start=q_start, k_start=k_start, k_scale=k_scale,
                                     v_scale=v_scale, k_mean=k_mean, v_mean=v_mean)
    return (o, lse) if return_lse else o


def _check_attention(q, k, v, causal, softmax_scale, q_start, k_start, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, return_lse, varlen, k_scale=None,
                     v_scale=None, k_mean=None, v_mean=None) -> float:
    """`attention`'s input checks; returns the softmax scale."""
    if varlen and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together (varlen mode)")
    if not varlen and (max_seqlen_q is not None or max_seqlen_k is not None):
        raise ValueError("max_seqlen_q / max_seqlen_k are for varlen inputs (with cu_seqlens_q / "
                         "cu_seqlens_k); a dense call's lengths are q's and k's shapes")
    if varlen and (k_scale is not None or v_scale is not None):
        raise ValueError("k_scale / v_scale (an fp8 k/v) are for dense inputs, not varlen")
    check_attention_inputs(q, k, v, softmax_scale, varlen, k_scale, v_scale)
    if not varlen:
        check_kv_means(k_mean, v_mean, k.dtype == FP8, q.shape[0], k, q.device, "k")
    elif k_mean is not None or v_mean is not None:
        raise ValueError("k_mean / v_mean (a smoothed fp8 k/v) are for dense inputs, not varlen")
    check_flag("causal", causal)
    check_flag("return_lse", return_lse)
    check_optional_int("max_seqlen_q", max_seqlen_q, 0)
    check_optional_int("max_seqlen_k", max_seqlen_k, 0)
    if varlen:
        _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], q.device, max_seqlen_q)
        _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], q.device, max_seqlen_k)
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(
                f"cu_seqlens_q has {cu_seqlens_q.numel() - 1} sequences but cu_seqlens_k has "
                f"{cu_seqlens_k.numel() - 1}"
            )
        batch = cu_seqlens_q.numel() - 1
    else:
        batch = q.shape[0]
    check_offset(q_start, "q_start", batch, q.device)
    check_offset(k_start, "k_start", batch, q.device)
    return softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5


def attention_merge_into(
    o_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    q_start: int | torch.Tensor = 0,
    k_start: int | torch.Tensor = 0,
) -> None:
    """In place: (o_acc, lse_acc) <- merge((o_acc, lse_acc), attention(q, k, v, ...)).

    A ring step's partial attention folded into the running state, i.e. `attention(...,
    return_lse=True)` followed by `longctx.merge.merge_into`, without writing the partial.

    Args:
        o_acc: [B, Sq, Hq, D] float32 running output (start at zeros).
        lse_acc: [B, Sq, Hq] float32 running LSE (start at -inf: the empty state).
        q, k, v, causal, softmax_scale, q_start, k_start: as in `attention` (dense layout).

    Backend: CUDA tensors run the prefill kernel (as `attention`) with the merge in its epilogue
    (the merge layer's rule, kernels/merge.py); CPU tensors run `attention` and then
    `merge_into`.
    """
    if use_triton_for(q) and (kl := _kl or _kernels()).fast_launch_active():
        dev = kl.current_device()
        try:
            sig = kl.signature
            key = (dev, sig(o_acc), sig(lse_acc), sig(q), sig(k), sig(v), causal, softmax_scale,
                   sig(q_start), sig(k_start))
            plan = _MERGE_PLANS.get(key)
        except TypeError:
            key = plan = None
        if plan is None:
            _check_attention_merge_into(o_acc, lse_acc, q, k, v, causal, softmax_scale, q_start,
                                        k_start)
            _kp.check_prefill_args(q, k, v, q_start, k_start, None, None, None, (o_acc, lse_acc))
            scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
            plan = _kp.PrefillPlan(q, k, v, softmax_scale=scale, causal=causal, q_start=q_start,
                                   k_start=k_start, cu_seqlens_q=None, cu_seqlens_k=None,
                                   max_seqlen_q=None, max_seqlen_k=None,
                                   accumulate=(o_acc, lse_acc), config=None)
            if key is not None:
                kl.remember(_MERGE_PLANS, key, plan)
        plan(q, k, v, q_start, k_start, None, None, (o_acc, lse_acc), dev)
        return
    _check_attention_merge_into(o_acc, lse_acc, q, k, v, causal, softmax_scale, q_start, k_start)
    if use_triton_for(q):
        _kernels()
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        _kp.flash_attention_fwd(q, k, v, softmax_scale=scale, causal=causal, q_start=q_start,
                                k_start=k_start, accumulate=(o_acc, lse_acc))
        return
    o, lse = attention(q, k, v, causal=causal, softmax_scale=softmax_scale, q_start=q_start,
                       k_start=k_start, return_lse=True)
    merge_into(o_acc, lse_acc, o, lse, check=False)


def _check_attention_merge_into(o_acc, lse_acc, q, k, v, causal, softmax_scale, q_start,
                                k_start) -> None:
    check_tensor("o_acc", o_acc)
    check_tensor("lse_acc", lse_acc)
    check_not_fp8("attention_merge_into", k, v)
    check_attention_inputs(q, k, v, softmax_scale)
    check_flag("causal", causal)
    check_offset(q_start, "q_start", q.shape[0], q.device)
    check_offset(k_start, "k_start", q.shape[0], q.device)
    check_accumulator(o_acc, lse_acc, q)
    if not lse_acc.is_cuda:  # as merge_into: values are free to read on CPU, a sync on CUDA
        check_lse(lse_acc, "lse_acc")


def _reference_varlen(q, k, v, cu_q, cu_k, causal, scale, q_start, k_start):
    """The reference, one packed sequence at a time: o [total_q, Hq, D], lse [total_q, Hq]."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    os_, lses = [], []
    for b in range(len(cq) - 1):
        qs = q_start[b] if isinstance(q_start, torch.Tensor) else q_start
        ks = k_start[b] if isinstance(k_start, torch.Tensor) else k_start
        o, lse = reference_attention(
            q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]],
            causal=causal, softmax_scale=scale, q_start=int(qs), k_start=int(ks),
        )
        os_.append(o[0])
        lses.append(lse[0])
    return torch.cat(os_), torch.cat(lses)
