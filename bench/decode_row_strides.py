"""Where the decode kernel loses time on a D=96 cache: one cache's values laid out with other head
and row strides (elements), longctx.decode on each (fp16, CUDA graph, cold L2: `launch/bench.py`
graph_ms, each layout twice, the faster kept). "contiguous" is [B, N, Hkv, 96]; "heads 128 apart"
pads each head to 128 columns (no 128-byte line holds two heads); "row +64" pads each token's row.

    python bench/decode_row_strides.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import graph_ms  # noqa: E402

from longctx.decode import decode  # noqa: E402

dev = torch.device("cuda")
print(torch.cuda.get_device_name())


def layout(x: torch.Tensor, head_stride: int, row_stride: int) -> torch.Tensor:
    """x [B, N, H, D] copied into a [B, N, H, D] view with these head and row strides."""
    B, N, H, D = x.shape
    buf = torch.zeros(B, N, row_stride, device=dev, dtype=x.dtype)
    out = buf.as_strided((B, N, H, D), (N * row_stride, row_stride, head_stride, 1))
    out.copy_(x)
    return out


for hq, hkv, B, N in ((16, 2, 1, 262144), (32, 4, 1, 262144), (16, 2, 64, 1024)):
    q = torch.randn(B, hq, 96, device=dev, dtype=torch.float16)
    k = torch.randn(B, N, hkv, 96, device=dev, dtype=torch.float16)
    v = torch.randn_like(k)
    lens = torch.full((B,), N, device=dev, dtype=torch.int32)
    variants = {"contiguous": (96, 96 * hkv), "heads 128 apart": (128, 128 * hkv),
                "heads 96 apart, row pow2": (96, 128 * hkv),
                "heads 128 apart, row +64": (128, 128 * hkv + 64),
                "heads 96 apart, row +64": (96, 96 * hkv + 64),
                "heads 160 apart": (160, 160 * hkv)}
    caches = {n: (layout(k, hs, rs), layout(v, hs, rs)) for n, (hs, rs) in variants.items()}
    ref = decode(q, k, v, cache_seqlens=lens)
    res = {n: [] for n in variants}
    for _ in range(2):
        for n, (kk, vv) in caches.items():
            assert (decode(q, kk, vv, cache_seqlens=lens) - ref).abs().max() < 1e-3
            res[n].append(graph_ms(lambda: decode(q, kk, vv, cache_seqlens=lens),
                                   warmup_ms=5, rep_ms=30) * 1e3)
    print(f"{hq}/{hkv} {B}x{N}: " + " | ".join(f"{n} {min(t):.1f}" for n, t in res.items()),
          flush=True)
    del q, k, v, caches
    torch.cuda.empty_cache()
