"""Tuning sweep for the Flash-Decoding kernel, timed under CUDA-graph replay (a development tool; results inform the heuristics
in kernels/decode.py). For each benchmark shape, times the split kernel + merge over num_splits
and launch configs, and prints the best against the heuristic's pick and the floor.

    python bench/tune_decode.py [--shapes 1x65536 16x4096] [--splits 1 2 4 8 16 32 64 128]
    python bench/tune_decode.py --fp8 ...   # an fp8 (e4m3) cache with its scales, bf16 q
    python bench/tune_decode.py --all ...   # every (splits, config)'s time, not only the best
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import graph_ms, stream_read_ms  # noqa: E402

from longctx.fp8 import quantize_kv  # noqa: E402
from longctx.kernels.bandwidth import read_bandwidth  # noqa: E402
from longctx.kernels.decode import (  # noqa: E402
    _launch_config, choose_num_splits, flash_decode_partials, splits_rule,
)
from longctx.kernels.merge import merge_states_triton  # noqa: E402
from longctx.kernels.utils import device_sms  # noqa: E402

TIMING = dict(warmup_ms=2, rep_ms=5)  # short: the sweep times hundreds of variants
SHAPES = ["256x256", "128x512", "64x1024", "32x2048", "16x4096", "8x8192", "4x16384",
          "2x32768", "1x65536", "1x131072", "1x262144"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=SHAPES)
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128])
    ap.add_argument("--configs", nargs="+", default=["64,4,2", "64,4,3", "64,4,4", "128,4,2", "128,8,2", "32,4,4"])
    ap.add_argument("--hq", type=int, default=16)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--fp8", action="store_true", help="e4m3 cache with per-(token, head) scales")
    ap.add_argument("--all", action="store_true", help="print every (splits, config)'s time")
    args = ap.parse_args()
    bw = read_bandwidth()
    sms = device_sms(torch.device("cuda"))
    print(f"read bandwidth {bw / 1e12:.2f} TB/s, {sms} SMs")
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs]
    for shape in args.shapes:
        B, N = (int(x) for x in shape.split("x"))
        dtype = torch.bfloat16 if args.fp8 else torch.float16
        q = torch.randn(B, args.hq, args.d, device="cuda", dtype=dtype)
        k = torch.randn(B, N, args.hkv, args.d, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        scales = {}
        if args.fp8:
            (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
            scales = dict(k_scale=ks, v_scale=vs)
        lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
        floor = 2 * (k.numel() * k.element_size() + 4 * k[..., 0].numel() * args.fp8) / bw * 1e6
        # What a pure stream of the same bytes takes under the same timing (graph replay, cold
        # L2): the floor as a single launch can reach it, launch latency and ramp included.
        t_read, t_empty = (t * 1e3 for t in stream_read_ms([k, v], **TIMING))
        results = {}
        for sp, cfg in itertools.product(args.splits, configs):
            def fn():
                if sp == 1:
                    return flash_decode_partials(q, k, v, lens, None, args.d**-0.5, 1,
                                                 out_dtype=q.dtype, config=cfg, **scales)
                o, lse = flash_decode_partials(q, k, v, lens, None, args.d**-0.5, sp, config=cfg,
                                               **scales)
                return merge_states_triton(o, lse, out_dtype=q.dtype)
            try:
                results[(sp, cfg)] = graph_ms(fn, **TIMING) * 1e3
            except Exception as e:  # a config that does not fit is skipped
                print(f"  skip {sp} {cfg}: {type(e).__name__}")
        best = min(results, key=results.get)
        h_sp = choose_num_splits(B, args.hkv, N, sms, **splits_rule(args.d, args.fp8, q.device))
        # an fp8 cache's dots run in float16 (kernels/decode.py `_widen_e4m3`)
        h_cfg = _launch_config(args.d, torch.float16 if args.fp8 else dtype, 16,
                               triton.cdiv(N, h_sp), q.device, args.fp8, h_sp * B * args.hkv)
        h = results.get((h_sp, h_cfg))
        by_split = {sp: min(t for (s, _), t in results.items() if s == sp) for sp in args.splits
                    if any(s == sp for s, _ in results)}
        print(f"B={B:<4} N={N:<7} floor {floor:6.1f} us | best {results[best]:6.1f} us "
              f"(splits {best[0]}, cfg {best[1]}) {100 * floor / results[best]:4.0f}% | heuristic "
              f"{h_sp} {h_cfg}: {h if h is None else round(h, 1)} us")
        print(f"    streaming read of the same bytes {t_read:.1f} us, empty kernel {t_empty:.1f} us")
        print("    best per split: " + " ".join(f"{sp}:{t:.1f}" for sp, t in by_split.items()))
        if args.all:
            for sp in args.splits:
                print(f"    splits {sp}: " + " ".join(f"{c}: {t:.1f}" for (s, c), t in results.items()
                                                     if s == sp))
        sp, cfg = best
        if sp > 1:  # where the time goes: the split kernel alone, and the merge alone
            o, lse = flash_decode_partials(q, k, v, lens, None, args.d**-0.5, sp, config=cfg,
                                           **scales)
            t_split = graph_ms(lambda: flash_decode_partials(q, k, v, lens, None, args.d**-0.5, sp,
                                                             config=cfg, **scales), **TIMING) * 1e3
            t_merge = graph_ms(lambda: merge_states_triton(o, lse, out_dtype=q.dtype), **TIMING) * 1e3
            print(f"    at the best: split kernel {t_split:.1f} us, merge kernel {t_merge:.1f} us")
        del q, k, v


if __name__ == "__main__":
    main()
