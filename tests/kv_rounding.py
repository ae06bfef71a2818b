"""A float32 KV cache that holds what a cache of another format would give back: bfloat16, or e4m3
with static scales (one per tensor or per KV head, calibrated on the first prefill chunk and
saturating later). The yardsticks of the fp8 cache's error (tests/test_fp8_kv.py,
bench/fp8_kv_error.py): formats longctx does not store, emulated on the float32 model."""

from __future__ import annotations

import torch

from longctx.decode import decode
from longctx.fp8 import quantize_fp8
from longctx.model import KVCache
from longctx.ops import rope_store_kv

FORMATS = ("bf16", "tensor", "head")


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
    """KVCache (float32) whose every stored K/V entry is rounded to `fmt` (FORMATS) first. Use
    as `model.make_cache = functools.partial(RoundedKVCache, fmt=...)` before setup_caches."""

    def __init__(self, *args, fmt: str) -> None:
        super().__init__(*args)
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        self.fmt, self.amax = fmt, None

    def _round(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if self.fmt == "bf16":
            return x.to(torch.bfloat16).to(x.dtype)
        return fake_quant(x, self.amax[i]).to(x.dtype)

    def store(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.amax is None and self.fmt != "bf16":
            self.amax = (static_amax(k, self.fmt), static_amax(v, self.fmt))
        super().store(start, self._round(k, 0), self._round(v, 1))

    def decode(self, q, k, v, step, rope, return_lse=False):
        slot, lens = step
        rope_store_kv(q, k, v, *rope, self.k_cache, self.v_cache, slot)
        b = torch.arange(q.shape[0], device=q.device)
        for i, cache in enumerate((self.k_cache, self.v_cache)):
            cache[b, slot] = self._round(cache[b, slot][:, None], i)[:, 0]
        return decode(q, self.k_cache, self.v_cache, cache_seqlens=lens, return_lse=return_lse)
