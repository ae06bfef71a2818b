"""The fp8-cache decode kernel's launch rule against its alternatives (a development tool; results
inform kernels/decode.py's FP8_SPLITS and `_launch_config`). For each shape: the bf16 cache
(longctx's own rule), optionally a previous decode kernel on the same fp8 cache, and the fp8
kernel at multiples of the one-wave split count with the launch configs of `CANDIDATES` (or
--candidates); CUDA-graph replay, µs per call (split kernel + merge), with the rule's pick and
the floor (the fp8 bytes and scales at the measured read bandwidth).

    python bench/fp8_decode_sweep.py [--baseline OLD.py] [--shapes 32/4/1x262144 ...]
        [--candidates 2:128,4,2 4:64,4,2 ...]   # MULT:BLOCK_N,warps,stages
        [--key-major [--head-major]]   # V stored key-major (and K and the scales head-major: the
                                       # model's fp8 cache) for the candidates and the rule
        [--page-size N]                # every fp8 cache paged (pages of N in order; the layouts
                                       # above within each page)
    # OLD.py: e.g. `git show 5425e66:kernels/decode.py > /tmp/decode_5425e66.py`
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import graph_ms  # noqa: E402

from longctx.fp8 import dequantize_kv, head_major, key_major_v, quantize_kv  # noqa: E402
from longctx.kernels import decode as D  # noqa: E402
from longctx.kernels.bandwidth import read_bandwidth  # noqa: E402
from longctx.kernels.merge import merge_states_triton  # noqa: E402
from longctx.kernels.utils import device_sms  # noqa: E402

TIMING = dict(warmup_ms=5, rep_ms=20)
SHAPES = [(16, 2, 64, 1024), (16, 2, 8, 8192), (16, 2, 1, 65536), (16, 2, 1, 262144),
          (64, 8, 8, 8192), (64, 8, 1, 262144), (32, 4, 8, 8192), (32, 4, 1, 262144),
          (32, 4, 1, 1048576)]
# (multiple of the one-wave split count, (BLOCK_N, warps, stages)): the rule's launches and their
# nearest rivals in the last sweep (bench/results/fp8-decode-k-layout-h100.txt). Shared memory per
# program since K's tile goes straight into the dot's operand (offline sm_90 compiles,
# bench/compile_decode.py): (128, 4, 2) 75 KB, (64, 2, 2) 39 KB, (64, 2, 3) 56 KB. Swept before
# and slower: 8 warps, 32-key blocks, one stage, six or eight programs per SM
# (bench/results/fp8-decode-*-h*.txt).
CANDIDATES = [(1, (128, 4, 3)), (2, (128, 4, 2)), (4, (64, 2, 2)), (4, (64, 2, 3)),
              (5, (64, 2, 2))]


def run(mod, q, k, v, lens, splits, cfg, scales, table=None):
    """Split kernel (+ merge) of decode module `mod` (kernels/decode.py or a previous one);
    table: a paged cache's block table."""
    if splits == 1:
        return mod.flash_decode_partials(q, k, v, lens, table, q.shape[-1] ** -0.5, 1,
                                         out_dtype=q.dtype, config=cfg, **scales)[0]
    o, lse = mod.flash_decode_partials(q, k, v, lens, table, q.shape[-1] ** -0.5, splits,
                                       config=cfg, **scales)
    out = merge_states_triton(o, lse, out_dtype=q.dtype)
    return out[0] if isinstance(out, tuple) else out


def bf16_launch(mod, B: int, hkv: int, N: int, sms: int, device: torch.device):
    """(splits, config) of a decode module's launch on a bf16 cache (head_dim 128, 16-row
    programs)."""
    sp = mod.choose_num_splits(B, hkv, N, sms)
    return sp, mod._launch_config(128, torch.bfloat16, 16, triton.cdiv(N, sp), device)


def fp8_launch(mod, B: int, hkv: int, N: int, sms: int, device: torch.device,
               key_major: bool = False):
    """(splits, config) of a decode module's own launch on an fp8 cache (head_dim 128, a bf16 q
    whose dots run in float16): its FP8_SPLITS and fp8 config (key_major: its V stored
    key-major, KEY_MAJOR_SPLITS), or for a previous module from before that rule the bf16
    cache's launch."""
    if key_major:
        sp = mod.choose_num_splits(B, hkv, N, sms, **mod.KEY_MAJOR_SPLITS)
        return sp, mod._launch_config(128, torch.float16, 16, triton.cdiv(N, sp), device, True,
                                      sp * B * hkv, True)
    if not hasattr(mod, "FP8_SPLITS"):
        return bf16_launch(mod, B, hkv, N, sms, device)
    sp = mod.choose_num_splits(B, hkv, N, sms, **mod.FP8_SPLITS)
    try:
        cfg = mod._launch_config(128, torch.float16, 16, triton.cdiv(N, sp), device, True,
                                 sp * B * hkv)
    except TypeError:  # a rule from before the program count was an argument
        cfg = mod._launch_config(128, torch.float16, 16, triton.cdiv(N, sp), device, True)
    return sp, cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="a previous kernels/decode.py, timed on the same fp8 cache")
    ap.add_argument("--shapes", nargs="+", metavar="HQ/HKV/BxN",
                    help="shapes to time (default: the decode table's and tp=2's)")
    ap.add_argument("--candidates", nargs="+", metavar="MULT:BLOCK_N,WARPS,STAGES",
                    help="launches to time, MULT x the one-wave split count (default: CANDIDATES)")
    ap.add_argument("--key-major", action="store_true",
                    help="the candidates and the rule on a key-major V (longctx.fp8.key_major_v); "
                         "the usual layout's rule is timed beside it")
    ap.add_argument("--head-major", action="store_true",
                    help="with --key-major: K and the scales head-major too (longctx.fp8."
                         "head_major), the model's fp8 cache")
    ap.add_argument("--page-size", type=int,
                    help="every fp8 cache paged, pages of this many keys in order (with "
                         "--key-major / --head-major those layouts within each page)")
    args = ap.parse_args()
    if args.head_major and not args.key_major:
        ap.error("--head-major goes with --key-major (the model's fp8 cache is both)")
    shapes, candidates = SHAPES, CANDIDATES
    try:
        if args.shapes:
            shapes = [(*map(int, h.split("/")[:2]), *map(int, h.split("/")[2].split("x")))
                      for h in args.shapes]
        if args.candidates:
            candidates = [(int(c.split(":")[0]), tuple(int(x) for x in c.split(":")[1].split(",")))
                          for c in args.candidates]
    except (ValueError, IndexError):
        ap.error("--shapes take HQ/HKV/BxN (e.g. 32/4/1x262144), --candidates "
                 "MULT:BLOCK_N,WARPS,STAGES (e.g. 2:128,4,2)")
    old = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("decode_baseline", args.baseline)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    bw, sms = read_bandwidth(), device_sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, read bandwidth {bw / 1e12:.2f} TB/s, {sms} SMs")
    print("candidates: " + " ".join(f"sp{m}x{c}" for m, c in candidates))
    for hq, hkv, B, N in shapes:
        q = torch.randn(B, hq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, N, hkv, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
        sp1, bf_cfg = bf16_launch(D, B, hkv, N, sms, q.device)
        t_bf16 = graph_ms(lambda: run(D, q, k, v, lens, sp1, bf_cfg, {}), **TIMING) * 1e3
        (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
        del k, v
        ps, table = args.page_size, None
        if ps:
            table = torch.arange(B * N // ps, device=q.device, dtype=torch.int32).view(B, -1)
            k8, v8, ks, vs = (t.view(B * N // ps, ps, *t.shape[2:]) for t in (k8, v8, ks, vs))
        scales = dict(k_scale=ks, v_scale=vs)
        t_rows = None
        if args.key_major:  # the usual layout's rule, then the sweep on the key-major copy
            sp_r, cfg_r = fp8_launch(D, B, hkv, N, sms, q.device)
            t_rows = graph_ms(lambda: run(D, q, k8, v8, lens, sp_r, cfg_r, scales, table),
                              **TIMING) * 1e3
        v_std = v8
        if args.key_major:
            v8 = key_major_v(v_std.shape, q.device, paged=bool(ps))
            v8.copy_(v_std)
        if args.head_major:
            k8, ks, vs = (head_major(t.shape, t.dtype, q.device, paged=bool(ps)).copy_(t)
                          for t in (k8, ks, vs))
            scales = dict(k_scale=ks, v_scale=vs)
        t_old = None
        if old is not None:
            sp_old, cfg = fp8_launch(old, B, hkv, N, sms, q.device)
            t_old = graph_ms(lambda: run(old, q, k8, v_std, lens, sp_old, cfg, scales, table),
                             **TIMING) * 1e3
        times = {}
        for mult, cfg in candidates:
            sp = min(sp1 * mult, max(1, N // 256))
            times[(sp, cfg)] = graph_ms(lambda: run(D, q, k8, v8, lens, sp, cfg, scales, table),
                                        **TIMING) * 1e3
        sp, cfg = fp8_launch(D, B, hkv, N, sms, q.device, D.key_major_rule(True, v8, ps))
        if (sp, cfg) not in times:
            times[(sp, cfg)] = graph_ms(lambda: run(D, q, k8, v8, lens, sp, cfg, scales, table),
                                        **TIMING) * 1e3
        o = run(D, q, k8, v8, lens, sp, cfg, scales, table)
        kf, vf = (dequantize_kv(t, sc).reshape(B, N, hkv, 128).repeat_interleave(hq // hkv, 2)
                  for t, sc in ((k8, ks), (v_std, vs)))
        p = (torch.einsum("bhd,bshd->bhs", q.float(), kf) * 128 ** -0.5).softmax(-1)
        err = (o.float() - torch.einsum("bhs,bshd->bhd", p, vf)).abs().max().item()
        del kf, vf, p
        t = times[(sp, cfg)]
        floor = 2 * (k8.numel() + 4 * ks.numel()) / bw * 1e6
        print(f"{hq}/{hkv} {B}x{N}: floor {floor:.1f} | bf16 {t_bf16:.1f}"
              + (f" | previous fp8 {t_old:.1f}" if t_old else "")
              + (f" | usual-layout rule {t_rows:.1f}" if t_rows else "")
              + " | " + " ".join(f"sp{s} {c}: {x:.1f}" for (s, c), x in times.items())
              + f" | rule sp{sp} {cfg}: {t:.1f} us, {100 * floor / t:.0f}% of floor, "
              f"{t_bf16 / t:.2f}x bf16" + (f", {t_old / t:.2f}x previous" if t_old else "")
              + (f", {t_rows / t:.2f}x the usual layout" if t_rows else "")
              + f", max err {err:.1e}", flush=True)
        del q, k8, v8, v_std, ks, vs


if __name__ == "__main__":
    main()
