"""Two costs of an fp8 decode step outside the attention kernel's key loop (a development tool;
BENCHMARKS.md, fp8 section, "Two costs outside the key loop"):
1. `rope_store_kv` (the step's RoPE and KV store, one launch) into a bf16 cache and into an fp8
   cache with V in the usual layout and key-major, at several positions;
2. the decode split kernel over a key-major V whose rows are padded to several multiples of
   keys (the model's capacity is its context plus the generated tokens, e.g. 2^20 + 64).
Kernel time from torch.profiler (warm, launched back to back), µs per call, 32/4 heads, D 128.

    python bench/fp8_step_costs.py [--capacities 16448 262208 1048640] [--pads 16 128 256 512]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from longctx.decode import decode
from longctx.fp8 import FP8, key_major_v, quantize_kv
from longctx.ops import rope_store_kv, rope_tables

HQ, HKV, D = 32, 4, 128


def kernel_us(fn: Callable[[], object], name: str, calls: int = 20) -> float:
    """Mean device µs of the kernels whose name contains `name` over `calls` calls of fn."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [e for e in p.key_averages() if name in e.key]
    return sum(e.self_device_time_total for e in rows) / max(sum(e.count for e in rows), 1)


def store_costs(capacities: list[int], dev: torch.device) -> None:
    print("rope_store_kv, µs per call (position capacity - 1):")
    print("| capacity | bf16 cache | fp8, V usual layout | fp8, V key-major |")
    print("|---|---|---|---|")
    for S in capacities:
        cos, sin = rope_tables(S, D, 1e6, dev)
        pos = torch.full((1,), S - 1, dtype=torch.int64, device=dev)
        q = torch.randn(1, HQ, D, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(1, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        shape = (1, S, HKV, D)
        bf = [torch.zeros(shape, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        k8, v8 = (torch.zeros(shape, device=dev, dtype=FP8) for _ in range(2))
        vkm = key_major_v(shape, dev)
        ks, vs = (torch.zeros(shape[:3], device=dev) for _ in range(2))
        t = [kernel_us(lambda: rope_store_kv(q, k, v, cos, sin, pos, *bf, pos), "rope_store"),
             kernel_us(lambda: rope_store_kv(q, k, v, cos, sin, pos, k8, v8, pos, ks, vs),
                       "rope_store"),
             kernel_us(lambda: rope_store_kv(q, k, v, cos, sin, pos, k8, vkm, pos, ks, vs),
                       "rope_store")]
        print(f"| {S} | " + " | ".join(f"{x:.2f}" for x in t) + " |", flush=True)
        del cos, sin, bf, k8, v8, vkm, ks, vs


def padding_costs(capacities: list[int], pads: list[int], dev: torch.device) -> None:
    print("\ndecode split kernel over a key-major V, µs per call, by the rows' padding "
          "(length capacity - 1; key_major_v's own padding last):")
    print("| capacity | " + " | ".join(f"rows padded to {p}" for p in pads)
          + " | key_major_v |")
    print("|---|" + "---|" * (len(pads) + 1))
    for cap in capacities:
        shape = (1, cap, HKV, D)
        k8, ks = quantize_kv(torch.randn(shape, device=dev, dtype=torch.bfloat16))
        v_rows, vs = quantize_kv(torch.randn(shape, device=dev, dtype=torch.bfloat16))
        q = torch.randn(1, HQ, D, device=dev, dtype=torch.bfloat16)
        lens = torch.full((1,), cap - 1, dtype=torch.int32, device=dev)
        cells = []
        for pad in [*pads, None]:
            if pad is None:
                v = key_major_v(shape, dev)
            else:
                keys = -(-cap // pad) * pad
                v = torch.zeros(1, HKV, D, keys, device=dev, dtype=FP8)[..., :cap]
                v = v.permute(0, 3, 1, 2)
            v.copy_(v_rows)
            t = kernel_us(lambda: decode(q, k8, v, cache_seqlens=lens, k_scale=ks, v_scale=vs),
                          "_decode_split", calls=10)
            cells.append(f"{t:.1f} (row {v.stride(-1)})")
            del v
        print(f"| {cap} | " + " | ".join(cells) + " |", flush=True)
        del k8, ks, v_rows, vs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacities", type=int, nargs="+", default=[16448, 262208, 1048640])
    ap.add_argument("--pads", type=int, nargs="+", default=[16, 128, 256, 512])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_step_costs.py times CUDA kernels: it needs a GPU")
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, {HQ}/{HKV} heads, head_dim {D}")
    store_costs(args.capacities, dev)
    padding_costs(args.capacities, args.pads, dev)


if __name__ == "__main__":
    main()
