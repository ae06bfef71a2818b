"""The split-KV decode kernel of this tree against a previous kernels/decode.py, on the same GPU:
each captured in a CUDA graph, timed in interleaved rounds with a cold L2 (`launch/bench.py`
interleaved_ms), cuDNN (torch SDPA) beside them. Every variant is first checked against a float32
reference over the same cache (the dequantized one for fp8): max error at most 2x cuDNN's (fp8:
at most 2x the previous kernel's).

    git show 1cf948a:kernels/decode.py > /tmp/decode_old.py
    python bench/decode_ab.py --baseline /tmp/decode_old.py [--cases d128 d96 fp8 paged]

The decode table's shapes (16/2 heads: 64 x 1024, 8 x 8192, 1 x 65536, 1 x 262144), fp16 q and
cache (fp8: bf16 q, e4m3 cache), each sequence 3 keys short of N (a ragged last block; cuDNN
reads all N); µs per call (split kernel + merge, each kernel's own launch rule), the median of
the rounds.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import capture_graph, interleaved_median_us  # noqa: E402

from longctx.fp8 import dequantize_kv, quantize_kv  # noqa: E402
from longctx.kernels import decode as D  # noqa: E402
from longctx.kernels.bandwidth import read_bandwidth  # noqa: E402

SHAPES = [(64, 1024), (8, 8192), (1, 65536), (1, 262144)]
CASES = {"d128": (128, False, 0), "d96": (96, False, 0), "fp8": (128, True, 0),
         "paged": (128, False, 256)}


def load(path: str):
    spec = importlib.util.spec_from_file_location("decode_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def case_inputs(b: int, n: int, d: int, fp8: bool, page: int, hq: int, hkv: int):
    """(q, k, v, lens, block_table, scales, k_ref, v_ref): the cache as the kernels take it and
    [B, N, Hkv, D] float32 K / V for the reference."""
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16 if fp8 else torch.float16)
    k, v = (torch.randn(b, n, hkv, d, device="cuda", dtype=q.dtype) for _ in range(2))
    lens = torch.full((b,), n - 3, device="cuda", dtype=torch.int32)  # a ragged last block
    scales, table = {}, None
    if fp8:
        (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
        scales = dict(k_scale=ks, v_scale=vs)
        k_ref, v_ref = dequantize_kv(k, ks), dequantize_kv(v, vs)
    else:
        k_ref, v_ref = k.float(), v.float()
    if page:
        per = n // page
        perm = torch.randperm(b * per, device="cuda").to(torch.int32)
        table = perm.view(b, per)
        k, v = (x.view(b * per, page, hkv, d)[torch.argsort(perm)].contiguous() for x in (k, v))
    return q, k, v, lens, table, scales, k_ref, v_ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", required=True, help="a previous kernels/decode.py")
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--heads", type=int, nargs=2, default=[16, 2])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    kernels = {"this tree": D, "baseline": load(args.baseline)}
    (hq, hkv), bw = args.heads, read_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, read bandwidth {bw / 1e12:.2f} TB/s; {hq}/{hkv} heads; "
          f"baseline {args.baseline}; µs per call (CUDA graph)")
    torch.manual_seed(0)
    rows = []
    for case in args.cases:
        d, fp8, page = CASES[case]
        for b, n in SHAPES:
            q, k, v, lens, table, scales, k_ref, v_ref = case_inputs(b, n, d, fp8, page, hq, hkv)
            mask = torch.arange(n, device="cuda") < lens[:, None]  # [B, N]
            kt, vt = (x.transpose(1, 2) for x in (k_ref, v_ref))
            ref = F.scaled_dot_product_attention(q[:, :, None].float(), kt, vt, enable_gqa=True,
                                                 attn_mask=mask[:, None, None])[:, :, 0]
            graphs, errs = {}, {}
            for name, mod in kernels.items():
                def fn(mod=mod):
                    return mod.flash_decode(q, k, v, lens, table, d ** -0.5, None, **scales)[0]
                errs[name] = (fn().float() - ref).abs().max().item()
                graphs[name] = capture_graph(fn).replay
            if not fp8:  # over all N keys (its masked path is another kernel), against that
                k_t, v_t = (x.to(q.dtype).contiguous() for x in (kt, vt))
                ref_n = F.scaled_dot_product_attention(q[:, :, None].float(), kt, vt,
                                                       enable_gqa=True)[:, :, 0]

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(q[:, :, None], k_t, v_t,
                                                              enable_gqa=True)[:, :, 0]
                errs["cuDNN"] = (cudnn().float() - ref_n).abs().max().item()
                graphs["cuDNN"] = capture_graph(cudnn).replay
            bound = 2 * (errs["cuDNN"] if "cuDNN" in errs else errs["baseline"]) + 1e-6
            if errs["this tree"] > bound:
                raise SystemExit(f"{case} {b} x {n}: error {errs['this tree']:.2e} > {bound:.2e}")
            us = interleaved_median_us(graphs, args.rounds)
            floor = 2 * k.numel() * k.element_size() / bw * 1e6
            rows.append((case, b, n, floor, us))
            print(f"  {case} {b} x {n}: floor {floor:.1f}, "
                  + ", ".join(f"{name} {t:.1f}" for name, t in us.items())
                  + "; max error " + ", ".join(f"{x} {e:.1e}" for x, e in errs.items()),
                  flush=True)
            graphs = None
            torch.cuda.empty_cache()
    print("\n| case | B x N | floor | this tree | baseline | cuDNN | baseline / this |")
    print("|---|---|---|---|---|---|---|")
    for case, b, n, floor, us in rows:
        cudnn = f"{us['cuDNN']:.1f}" if "cuDNN" in us else "-"
        print(f"| {case} | {b} x {n} | {floor:.1f} | {us['this tree']:.1f} | "
              f"{us['baseline']:.1f} | {cudnn} | {us['baseline'] / us['this tree']:.3f}x |")


if __name__ == "__main__":
    main()
