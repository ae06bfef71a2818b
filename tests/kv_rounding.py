"""A float32 KV cache that holds what a cache of another format would give back: bfloat16, or e4m3
with static scales (one per tensor or per KV head, calibrated on the first prefill chunk and
saturating later), or longctx's own e4m3 rule (a scale per token and KV head) on K or V alone.
The yardsticks of the fp8 cache's error (tests/test_fp8_kv.py, bench/fp8_kv_error.py): formats
longctx does not store, emulated on the float32 model."""

from __future__ import annotations

import torch

from longctx.decode import decode
from longctx.fp8 import dequantize_kv, quantize_fp8, quantize_kv
from longctx.model import KVCache
from longctx.ops import rope_store_kv

FORMATS = ("none", "bf16", "tensor", "head", "row")  # row: longctx.fp8.quantize_kv's


def fake_quant(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x through e4m3 with the static amax (broadcastable to x), saturating; float32."""
    x_fp8, scale = quantize_fp8(x.float().clamp(-amax, amax), amax)
    return x_fp8.float() * scale


def static_amax(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [B, S, Hkv, D] -> its |max| per tensor [1, 1, 1, 1] ("tensor") or per KV head
    [1, 1, Hkv, 1] ("head")."""
    dims = (0, 1, 2, 3) if fmt == "tensor" else (0, 1, 3)
    return x.float().abs().amax(dim=dims, keepdim=True).clamp_min(1e-30)


class RoundedKVCache(KVCache):
    """KVCache (float32) whose every stored K and V entry is rounded first, to `fmt` (FORMATS),
    or K's to fmt[0] and V's to fmt[1]. Use as `model.make_cache = functools.partial(
    RoundedKVCache, fmt=...)` before setup_caches."""

    def __init__(self, *args, fmt: str | tuple[str, str], smooth: bool = True) -> None:
        super().__init__(*args)  # a float32 cache: `smooth` is for fp8 ones
        self.fmt = (fmt, fmt) if isinstance(fmt, str) else tuple(fmt)
        if len(self.fmt) != 2 or any(f not in FORMATS for f in self.fmt):
            raise ValueError(f"fmt must be one of {FORMATS} or a (K, V) pair of them, got {fmt!r}")
        self.amax = None

    def _round(self, x: torch.Tensor, i: int) -> torch.Tensor:
        fmt = self.fmt[i]
        if fmt == "none":
            return x
        if fmt == "bf16":
            return x.to(torch.bfloat16).to(x.dtype)
        if fmt == "row":
            return dequantize_kv(*quantize_kv(x), x.dtype)
        return fake_quant(x, self.amax[i]).to(x.dtype)

    def store(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.amax is None:  # static scales: the first chunk's (used by "tensor" / "head")
            self.amax = tuple(static_amax(x, f if f in ("tensor", "head") else "tensor")
                              for x, f in zip((k, v), self.fmt))
        super().store(start, self._round(k, 0), self._round(v, 1))

    def decode(self, q, k, v, step, rope, return_lse=False):
        slot, lens = step
        rope_store_kv(q, k, v, *rope, self.k_cache, self.v_cache, slot)
        b = torch.arange(q.shape[0], device=q.device)
        for i, cache in enumerate((self.k_cache, self.v_cache)):
            cache[b, slot] = self._round(cache[b, slot][:, None], i)[:, 0]
        return decode(q, self.k_cache, self.v_cache, cache_seqlens=lens, return_lse=return_lse)
