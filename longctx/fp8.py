"""fp8 (e4m3) KV cache: the quantization rule, its inverse, and the checks of a cache's scales.

The cache holds K and V as torch.float8_e4m3fn with one float32 scale per (token, KV head):
x ~ x_fp8 * scale, scale = amax(|x| over head_dim) / 448 (e4m3's largest finite value), so each
row uses e4m3's whole range and no calibration is needed. Scales are laid out like the cache
without head_dim: [B, S_max, Hkv] (any strides), paged [num_pages, page_size, Hkv]; 4 bytes per
head_dim bytes (3% at head_dim 128). bench/fp8_kv_error.py measures this granularity against one
scale per tensor and one per KV head. An all-zero row gets scale 0 and zeros, never NaN.

Smoothing (optional; the model's fp8 cache uses it): K and V may be stored less a mean per
(sequence, KV head, channel), k_mean / v_mean [B, Hkv, D] float32, so that x ~ x_fp8 * scale +
mean. Channels whose values sit far from zero (K's outlier channels) then stop setting every
row's scale; the model takes the means over the first prefill chunk's keys and values
(`kv_means`) and keeps them for the sequence (measured in BENCHMARKS.md, fp8 section). The
attention does not dequantize the means: over keys k + m_k every score gains the same q.m_k, so
softmax weights are unchanged and only the LSE moves by softmax_scale q.m_k, and the weights
sum to 1, so the output gains m_v (`add_kv_means`; the decode kernel does it in its epilogue).
Each partial state is exact on its own, so merges across splits and ranks need nothing more.

The kernels that write the cache quantize (kernels/fused.py); the attention kernels read fp8
and apply the scales per key in registers (kernels/decode.py, kernels/prefill.py). The torch
code here is the rule they follow bit for bit and the CPU backend.
"""

from __future__ import annotations

import torch

from longctx.kernels.utils import device_capability

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
# `kv_cache_dtype` config values: None = the model's dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8_e4m3": FP8}


def quantize_fp8(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any float dtype) with amax broadcastable to it (e.g. x's |max| over some dims, keepdim)
    -> (x_fp8 float8_e4m3fn shaped like x, scale = amax / 448 float32 shaped like amax), so that
    x ~ x_fp8 * scale. Division in float32 by the scale (a zero scale divides by 1: zeros)."""
    scale = amax.float() / FP8_MAX
    x_fp8 = (x.float() / torch.where(scale == 0, 1.0, scale)).to(FP8)
    return x_fp8, scale


def quantize_kv(x: torch.Tensor,
                mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (x_fp8 [..., D] float8_e4m3fn, scale [...] float32): one scale per row
    (per token and KV head for K or V [B, S, Hkv, D]), as the cache-writing kernels compute it.
    mean: float32 broadcastable to x (smoothing, above): x - mean (in float32) is quantized."""
    xf = x.float() if mean is None else x.float() - mean
    x_fp8, scale = quantize_fp8(xf, xf.abs().amax(dim=-1, keepdim=True))
    return x_fp8, scale.squeeze(-1)


def dequantize_kv(x_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                  mean: torch.Tensor | None = None) -> torch.Tensor:
    """x_fp8 [..., D] float8_e4m3fn, scale [...] float32 -> x_fp8 * scale [..., D] in `dtype`
    (the product in float32, exact in float64 for dtype float64, then rounded to dtype),
    contiguous whatever x_fp8's layout (a key-major V's strides would otherwise carry over).
    mean: float32 broadcastable to x_fp8 (smoothing): x_fp8 * scale + mean, rounded once to
    float32 as a fused multiply-add rounds it (exact in float64 first), then to dtype."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    if mean is not None:
        x = x_fp8.double() * scale[..., None].double() + mean.double()
        return x.to(wide).to(dtype).contiguous()
    return (x_fp8.to(wide) * scale[..., None].to(wide)).to(dtype).contiguous()


def kv_means(x: torch.Tensor, group=None) -> torch.Tensor:
    """The smoothing means of a chunk x [B, S, Hkv, D] (rotated K, or V): its mean over the
    chunk's S positions, [B, Hkv, D] float32 (zeros for an empty chunk). Summed in float64, so
    the order of the sum leaves no trace once rounded to float32. group: x is this rank's share
    of a chunk split over a torch.distributed group (the same number of positions on each
    rank); the sums are all-reduced over it, so every rank gets one process's means."""
    sums, count = x.double().sum(dim=1), x.shape[1]
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(sums, group=group)
        count *= dist.get_world_size(group)
    return (sums / max(count, 1)).float()


def add_kv_means(o: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k_mean: torch.Tensor,
                 v_mean: torch.Tensor, softmax_scale: float) -> None:
    """In place: the attention state (o [B, Sq, Hq, D], lse [B, Sq, Hq] float32) over keys k
    and values v becomes the state over k + k_mean and v + v_mean (k_mean, v_mean [B, Hkv, D]
    float32, KV head h // (Hq / Hkv) for query head h; q [B, Sq, Hq, D] the queries): lse +=
    softmax_scale q.k_mean and o += v_mean, in float32 (float64 for a float64 o), for rows that
    see a key (lse > -inf; empty rows stay o = 0, lse = -inf). The rule and the CPU path
    (longctx.ops.add_kv_means runs one kernel on CUDA)."""
    B, S, Hq, D = o.shape
    hkv = k_mean.shape[1]
    wide = torch.float64 if o.dtype == torch.float64 else torch.float32
    km, vm = (m[:, None, :, None].to(wide) for m in (k_mean, v_mean))  # [B, 1, Hkv, 1, D]
    groups = (B, S, hkv, Hq // hkv)
    seen = (lse != float("-inf")).reshape(*groups, 1)
    o.copy_(torch.where(seen, o.to(wide).reshape(*groups, D) + vm, 0.0).reshape(o.shape))
    lse.add_(((q.to(wide).reshape(*groups, D) * km).sum(-1) * softmax_scale).reshape(lse.shape))


def check_kv_means(k_mean: object, v_mean: object, fp8: bool, batch: int, k_cache: torch.Tensor,
                   device: torch.device, k_name: str = "k_cache") -> bool:
    """Smoothing means (above), both or neither, for an fp8 cache only: float32 [batch, Hkv, D]
    (k_cache's heads and head_dim), contiguous, on `device`. Returns whether they are given;
    ValueError naming the argument otherwise."""
    if k_mean is None and v_mean is None:
        return False
    if not fp8:
        raise ValueError(f"k_mean / v_mean are for an fp8 ({FP8}) {k_name}; {k_name} is "
                         f"{k_cache.dtype}")
    want = (batch, k_cache.shape[2], k_cache.shape[3])
    for name, m in (("k_mean", k_mean), ("v_mean", v_mean)):
        if m is None:
            raise ValueError(f"k_mean and v_mean come together; {name} is None")
        if not isinstance(m, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(m).__name__}")
        if m.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {m.dtype}")
        if tuple(m.shape) != want:
            raise ValueError(f"{name} must be [B, Hkv, D] = {list(want)}, got {list(m.shape)}")
        if not m.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {m.stride()}")
        if m.device != device:
            raise ValueError(f"{name} is on {m.device} but q is on {device}")
    return True


# Triton compiles float8_e4m3fn for sm_89 (Ada) and later only (so does the decode kernel's
# cvt.rn.f16x2.e4m3x2); on an A100 an fp8 cache would fail to compile, deep in a kernel.
FP8_MIN_CAPABILITY = (8, 9)


def check_fp8_device(device: torch.device, what: str) -> None:
    """ValueError naming `what` (the fp8 cache or its config key) unless `device` can hold an
    fp8 cache: the CPU (the torch code) or a GPU of compute capability 8.9 or later."""
    cap = device_capability(device)
    if cap is not None and cap < FP8_MIN_CAPABILITY:
        raise ValueError(f"{what} needs a GPU of compute capability 8.9 or later (Ada, Hopper, "
                         f"Blackwell), where Triton compiles float8_e4m3fn; {device} has "
                         f"{cap[0]}.{cap[1]}")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """`kv_cache_dtype` config value -> the cache's dtype ('auto': the model's)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


def kv_bytes_per_element(cache_dtype: torch.dtype, head_dim: int) -> float:
    """Bytes per K or V element of a cache in cache_dtype, its scales included (fp8: one float32
    per head_dim elements)."""
    e = torch.empty((), dtype=cache_dtype).element_size()
    return e + (4 / head_dim if cache_dtype == FP8 else 0)


# Key-major V: an fp8 V cache may be stored with its keys contiguous, physically [B, Hkv, D, S_pad]
# (S_pad: at least S rounded up to KEY_MAJOR_ALIGN), seen as the usual [B, S, Hkv, D] view with strides
# (Hkv * D * S_pad, 1, D * S_pad, S_pad). P @ V reduces over keys, so that layout lets the decode
# kernel take V's e4m3 tile straight into the dot's operand as it does K's, with no float16 copy
# through shared memory (1.15-1.33x on an H200: BENCHMARKS.md, fp8 section). The kernels read a
# key-major V 16 keys at a time: slots from a sequence's length up to the next multiple of 16 are
# read (times a zero probability), so they must hold finite values; a cache from `key_major_v`
# (zero-filled) and written by longctx's kernels always does. A paged cache may hold V key-major
# within each page ([num_pages, Hkv, D, page_size], vLLM's paged V layout: `key_major_v(...,
# paged=True)`), the same contract applying to each page's slots.
KEY_MAJOR_ALIGN = 16
# `key_major_v` pads each row further, to a whole number of 128-byte lines: the decode kernel
# reads 128 keys of a row at a time, and rows starting mid-line (a capacity of 2^20 + 64 keys,
# the model's context plus its generated tokens) made it 7% slower on an H200 (281.3 against
# 261.9 us a layer at tp=2's 32/4 heads, 1,048,640 keys; BENCHMARKS.md, fp8 section).
KEY_MAJOR_ROW_ALIGN = 128


def _keys_padded(S: int, align: int = KEY_MAJOR_ALIGN) -> int:
    """The keys a key-major V's rows hold for S positions: S rounded up to `align` (the least
    the kernels take, or KEY_MAJOR_ROW_ALIGN as `key_major_v` makes them)."""
    return -(-max(S, 1) // align) * align


def check_page_size(page: int, name: str) -> None:
    """A paged cache's page_size (dim 1 of `name`): a power of two >= 16, the decode kernel's
    smallest key block (and a key-major page's row alignment, KEY_MAJOR_ALIGN)."""
    if page < KEY_MAJOR_ALIGN or page & (page - 1):
        raise ValueError(f"paged {name}: page_size (dim 1) must be a power of two >= "
                         f"{KEY_MAJOR_ALIGN}, got {page}")


def _rows(S: int, paged: bool) -> int:
    """Positions a row of a key-major or head-major tensor holds: a page's page_size (checked,
    kept as is) for a paged cache, else S padded to KEY_MAJOR_ROW_ALIGN."""
    if paged:
        check_page_size(S, "cache")
        return S
    return _keys_padded(S, KEY_MAJOR_ROW_ALIGN)


def key_major_v(shape: tuple[int, int, int, int], device: torch.device | str,
                paged: bool = False) -> torch.Tensor:
    """A zero-filled fp8 V cache of logical shape [B, S, Hkv, D], stored key-major (above), its
    rows S rounded up to KEY_MAJOR_ROW_ALIGN keys long. paged: shape is a paged cache's
    [num_pages, page_size, Hkv, D], each page physically [Hkv, D, page_size] (vLLM's paged V
    layout; the decode kernel's key-major read per page)."""
    B, S, H, D = shape
    return torch.zeros((B, H, D, _rows(S, paged)), dtype=FP8,
                       device=device)[..., :S].permute(0, 3, 1, 2)


def head_major(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
               paged: bool = False) -> torch.Tensor:
    """A zero-filled tensor of logical shape [B, S, Hkv, ...] stored head-major: physically
    [B, Hkv, S_pad, ...] (S rounded up to KEY_MAJOR_ROW_ALIGN), each head's positions
    contiguous. The model's fp8 K cache and both scales take it: a split of the decode kernel
    then reads one run of bytes per head instead of Hkv interleaved ones (2-4% faster at 32/4
    and 64/8 heads on an H200; with the usual [B, S, Hkv] layout the scales' 4 bytes a key sat
    Hkv * 4 bytes apart; BENCHMARKS.md, fp8 section). Kernels take it by its strides.
    paged: shape is a paged cache's [num_pages, page_size, Hkv, ...], each page physically
    [Hkv, page_size, ...] (unpadded)."""
    B, S, H, *rest = shape
    return torch.zeros((B, H, _rows(S, paged), *rest), dtype=dtype,
                       device=device)[:, :, :S].transpose(1, 2)


def model_layout(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor,
                 v_scale: torch.Tensor, paged: bool = False) -> tuple[torch.Tensor, ...]:
    """Copies of an fp8 cache (k, v [B, S, Hkv, D] float8_e4m3fn; k_scale, v_scale [B, S, Hkv]
    float32, any layout) in the layout the model's cache keeps (longctx.model.KVCache): k and
    both scales `head_major`, v `key_major_v`. Returns (k, v, k_scale, v_scale), same values.
    paged: a paged cache ([num_pages, page_size, Hkv, ...]), laid out so within each page."""
    k_hm, ks_hm, vs_hm = (head_major(t.shape, t.dtype, t.device, paged).copy_(t)
                          for t in (k, k_scale, v_scale))
    return k_hm, key_major_v(v.shape, v.device, paged).copy_(v), ks_hm, vs_hm


def is_key_major(v: torch.Tensor) -> bool:
    """Whether v [..., S, Hkv, D] is laid out key-major (unit stride along keys, not along
    head_dim); `check_key_major` says whether that layout is one the kernels take."""
    return v.dim() == 4 and v.shape[-1] > 1 and v.stride(-1) != 1 and v.stride(1) == 1


def check_key_major(v: torch.Tensor, name: str = "v_cache") -> None:
    """ValueError naming `name` unless v, a key-major [B, S, Hkv, D] tensor, is one the kernels
    read: float8_e4m3fn, head_dim stride a multiple of 16 and at least S rounded up to 16 (the
    16-key reads past a sequence's length stay inside its row), heads and batches not
    overlapping, a 16-byte-aligned start, and storage behind all of it."""
    B, S, H, D = v.shape
    sb, _, sh, sd = v.stride()
    s16 = _keys_padded(S)
    if v.dtype != FP8:
        raise ValueError(f"{name} must have unit stride in its last (head_dim) dim (only an fp8 "
                         f"({FP8}) V may be key-major), got {v.dtype} with strides {v.stride()}")
    if (sd % KEY_MAJOR_ALIGN or sd < s16 or sh < D * sd or (B > 1 and sb < H * sh)
            or v.storage_offset() % KEY_MAJOR_ALIGN):
        raise ValueError(
            f"{name} is key-major (unit stride along keys) but not laid out as the kernels read "
            f"it: need a head_dim stride that is a multiple of {KEY_MAJOR_ALIGN} and >= {s16} "
            f"(the keys rounded up), non-overlapping heads and batches and a 16-byte-aligned "
            f"start, got strides {v.stride()} at offset {v.storage_offset()} "
            f"(longctx.fp8.key_major_v makes one)")
    last = v.storage_offset() + (B - 1) * sb + (H - 1) * sh + (D - 1) * sd + s16
    if v.untyped_storage().nbytes() < last:
        raise ValueError(f"{name} is key-major, and the kernels read each (batch, head, column) "
                         f"row to {s16} keys (S rounded up to {KEY_MAJOR_ALIGN}): its storage "
                         f"holds {v.untyped_storage().nbytes()} bytes, {last} needed "
                         f"(longctx.fp8.key_major_v makes one)")


def check_kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: object,
                    v_scale: object, device: torch.device, k_name: str = "k_cache",
                    v_name: str = "v_cache") -> bool:
    """An fp8 cache needs k_scale and v_scale: float32, shaped like the cache without head_dim,
    on `device`, any strides (e.g. `head_major`); a cache in another dtype takes none. Returns
    whether the cache is fp8. ValueError naming the argument otherwise."""
    fp8 = k_cache.dtype == FP8
    if fp8:
        check_fp8_device(device, f"an fp8 {k_name}")
    for name, s, cache, cname in (("k_scale", k_scale, k_cache, k_name),
                                  ("v_scale", v_scale, v_cache, v_name)):
        if not fp8:
            if s is not None:
                raise ValueError(f"{name} is for an fp8 ({FP8}) {cname}; {cname} is {cache.dtype}")
            continue
        if s is None:
            raise ValueError(f"an fp8 {cname} needs {name} (float32, {cname}'s shape without "
                             f"head_dim: {tuple(cache.shape[:-1])})")
        if not isinstance(s, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(s).__name__}")
        if s.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {s.dtype}")
        if s.shape != cache.shape[:-1]:
            raise ValueError(f"{name} must have {cname}'s shape without head_dim "
                             f"{tuple(cache.shape[:-1])}, got {tuple(s.shape)}")
        if s.device != device:
            raise ValueError(f"{name} is on {s.device} but q is on {device}")
    return fp8
