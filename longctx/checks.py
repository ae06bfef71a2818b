"""Input validation shared by the public API: every error names the argument and what was expected."""

from __future__ import annotations

import torch

from longctx.fp8 import FP8, check_key_major, check_kv_scales, is_key_major

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_head_dim(d: int, name: str = "q") -> None:
    # FlashAttention's and cuDNN's range. A multiple of 8 keeps every fp16 / bf16 row and head
    # 16-byte aligned (TMA, vector loads); the kernels pad their tiles to the next power of two.
    if d < 16 or d > 256 or d % 8:
        raise ValueError(f"{name}.shape[-1] (head_dim) must be a multiple of 8 in [16, 256], "
                         f"got {d}")


def check_dtype(t: torch.Tensor, name: str) -> None:
    allowed = KERNEL_DTYPES + ((torch.float64,) if t.device.type == "cpu" else ())
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name} must be one of {names} on {t.device.type}, got {t.dtype}")


def check_same(ref: torch.Tensor, ref_name: str, **others: torch.Tensor) -> None:
    """Same dtype and device as `ref` for every named tensor."""
    for name, t in others.items():
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")
        if t.dtype != ref.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}")


def check_gqa(hq: int, hkv: int, k_name: str = "k") -> None:
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of {k_name}'s KV heads ({hkv}) for GQA"
        )


def check_softmax_scale(scale: float | None) -> None:
    if scale is not None and (isinstance(scale, bool) or not (
            isinstance(scale, (int, float)) and 0 < scale < float("inf"))):
        raise ValueError(f"softmax_scale must be a positive finite number or None, got {scale!r}")


def check_offset(x: int | torch.Tensor, name: str, batch: int, device: torch.device) -> None:
    """q_start / k_start: a Python int or an integer tensor of shape [batch] on `device`."""
    if isinstance(x, torch.Tensor):
        if x.dtype not in (torch.int32, torch.int64) or x.shape != (batch,):
            raise ValueError(
                f"{name} must be an int or an int32/int64 tensor of shape [{batch}], "
                f"got {x.dtype} {tuple(x.shape)}"
            )
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but q is on {device}")
    elif not isinstance(x, int) or isinstance(x, bool):
        raise ValueError(f"{name} must be an int or a [batch] integer tensor, got {type(x).__name__}")


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None,
    varlen: bool = False,
    k_scale: object = None,
    v_scale: object = None,
) -> None:
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (varlen: [total, H, D]): shapes, dtype, device,
    strides (unit in head_dim, but a dense fp8 v may be key-major: longctx.fp8.check_key_major),
    head_dim, GQA and scale; an fp8 k/v's scales (longctx.fp8.check_kv_scales).

    Shared by `attention` and the ring, which must reject bad input before any rank communicates.
    """
    nd = 3 if varlen else 4
    layout = "[total, heads, head_dim] (varlen)" if varlen else "[batch, seq, heads, head_dim]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != nd:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    # An fp8 cache's V may be stored key-major (longctx.fp8), dense only.
    key_major = not varlen and k.dtype == FP8 and is_key_major(v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 and not (t is v and key_major):
            raise ValueError(f"{name} must have unit stride in its last (head_dim) dim")
    if key_major:
        check_key_major(v, "v")
    check_dtype(q, "q")
    if k.dtype == FP8:  # an fp8 cache's history: q keeps its dtype, the scales come along
        check_same(k, "k", v=v)
        if k.device != q.device:
            raise ValueError(f"k is on {k.device} but q is on {q.device}")
    else:
        check_same(q, "q", k=k, v=v)
    check_kv_scales(k, v, k_scale, v_scale, q.device, "k", "v")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if not varlen and k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {q.shape[0]}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k has head_dim {k.shape[-1]} but q has head_dim {q.shape[-1]}")
    check_head_dim(q.shape[-1])
    check_gqa(q.shape[-2], k.shape[-2])
    check_softmax_scale(softmax_scale)


def check_accumulator(o_acc: torch.Tensor, lse_acc: torch.Tensor, q: torch.Tensor) -> None:
    """A running (O, LSE) state to merge attention over q into: o_acc [..., D] float32 shaped
    like q, lse_acc float32 shaped like q without head_dim, on q's device (float64 for float64
    q: the exact reference's path)."""
    ok = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
    if o_acc.dtype not in ok or lse_acc.dtype != o_acc.dtype:
        raise ValueError(f"o_acc and lse_acc must both be float32 (or both float64 for float64 q), "
                         f"got {o_acc.dtype} and {lse_acc.dtype}")
    if o_acc.shape != q.shape or lse_acc.shape != q.shape[:-1]:
        raise ValueError(f"o_acc {tuple(o_acc.shape)} and lse_acc {tuple(lse_acc.shape)} must be "
                         f"shaped like q {tuple(q.shape)} and q without head_dim")
    if o_acc.device != q.device or lse_acc.device != q.device:
        raise ValueError(f"o_acc ({o_acc.device}) and lse_acc ({lse_acc.device}) must be on q's "
                         f"device {q.device}")
    if o_acc.stride(-1) != 1:
        raise ValueError(f"o_acc needs unit stride in head_dim, got strides {o_acc.stride()}")
    check_no_overlap("o_acc", o_acc)
    check_no_overlap("lse_acc", lse_acc)


def check_no_overlap(name: str, t: torch.Tensor) -> None:
    """`t` is written in place: a dim of stride 0 and size > 1 (an expand()ed view) would have
    several writers race for one element, so it is refused."""
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        raise ValueError(f"{name} is written in place, so its elements must not share memory; "
                         f"got shape {tuple(t.shape)} with strides {t.stride()} (an expand()ed "
                         f"view?): pass a tensor of its own, e.g. .clone()")


def check_not_fp8(fn: str, k: torch.Tensor, v: torch.Tensor) -> None:
    """`fn` reads k / v in q's dtype: an fp8 cache (with its scales) is for attention / decode."""
    if FP8 in (getattr(k, "dtype", None), getattr(v, "dtype", None)):
        raise ValueError(f"{fn} takes k and v in q's dtype, not an fp8 cache (got "
                         f"{getattr(k, 'dtype', k)!r} / {getattr(v, 'dtype', v)!r}); "
                         "longctx.attention and longctx.decode read one, with k_scale / v_scale")


def check_tensor(name: str, x: object) -> None:
    """`x` is a torch.Tensor (not None, a list or an array)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_flag(name: str, x: object) -> None:
    """A yes/no option is a bool: a truthy string or number would silently mean True."""
    if not isinstance(x, bool):
        raise ValueError(f"{name} must be True or False, got {x!r}")


def check_optional_int(name: str, x: object, minimum: int) -> None:
    """None, or an int (not a bool) >= minimum."""
    if x is not None and (not isinstance(x, int) or isinstance(x, bool) or x < minimum):
        raise ValueError(f"{name} must be an int >= {minimum} or None, got {x!r}")
