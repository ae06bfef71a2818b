"""The decode kernel and cuDNN on one cache in two memory layouts: token-major [B, N, Hkv, D]
(longctx's, FlashAttention's and vLLM's cache) and head-major [B, Hkv, N, D] (what SDPA takes
contiguous, and the decode table gives cuDNN). Each is handed the other's layout as a strided
view, so every number compares the same bytes in the same places.

    python bench/decode_layouts.py [--dims 96 128] [--heads 16 2]

fp16, the decode table's shapes, every sequence full (cuDNN has no lengths); each variant
checked against a float32 reference within 2x cuDNN's error on its own layout, then captured in
a CUDA graph and timed in interleaved rounds with a cold L2 (`launch/bench.py` interleaved_ms);
µs per call, the median of the rounds, and the floor (the cache's bytes at the measured read
bandwidth).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import capture_graph, interleaved_median_us  # noqa: E402

import longctx  # noqa: E402
from longctx.kernels.bandwidth import read_bandwidth  # noqa: E402

SHAPES = [(64, 1024), (8, 8192), (1, 65536), (1, 262144)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[96, 128])
    ap.add_argument("--heads", type=int, nargs=2, default=[16, 2])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    (hq, hkv), bw = args.heads, read_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, read bandwidth {bw / 1e12:.2f} TB/s; {hq}/{hkv} heads, fp16; "
          "µs per call (CUDA graph, cold L2)")
    torch.manual_seed(0)
    rows = []
    for d in args.dims:
        for b, n in SHAPES:
            q = torch.randn(b, hq, d, device="cuda", dtype=torch.float16)
            k_tok, v_tok = (torch.randn(b, n, hkv, d, device="cuda", dtype=q.dtype)
                            for _ in range(2))
            k_head, v_head = (x.transpose(1, 2).contiguous() for x in (k_tok, v_tok))
            ref = F.scaled_dot_product_attention(q[:, :, None].float(),
                                                 k_head.float(), v_head.float(),
                                                 enable_gqa=True)[:, :, 0]
            # [B, N, Hkv, D] views of each layout for longctx, [B, Hkv, N, D] views for cuDNN
            layouts = {"token-major": (k_tok, v_tok),
                       "head-major": (k_head.transpose(1, 2), v_head.transpose(1, 2))}
            fns = {}
            for name, (k, v) in layouts.items():
                fns[f"longctx {name}"] = lambda k=k, v=v: longctx.decode(q, k, v)

                def cudnn(k=k, v=v):
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(
                            q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                            enable_gqa=True)[:, :, 0]
                fns[f"cuDNN {name}"] = cudnn
            errs = {}
            for name, fn in list(fns.items()):
                try:
                    errs[name] = (fn().float() - ref).abs().max().item()
                except RuntimeError as e:  # a layout cuDNN refuses: said, not timed
                    if not name.startswith("cuDNN"):
                        raise
                    print(f"  D={d} {b} x {n}: {name} not run ({str(e).splitlines()[0]})")
                    errs[name] = float("inf")
                    del fns[name]
            # within 2x cuDNN's error on the same layout (or on the other, where it refused)
            for layout in layouts:
                peer = errs[f"cuDNN {layout}"]
                if peer == float("inf"):
                    peer = min(errs[f"cuDNN {x}"] for x in layouts)
                bound = 2 * peer + 1e-6
                if errs[f"longctx {layout}"] > bound:
                    raise SystemExit(f"D={d} {b} x {n} {layout}: error "
                                     f"{errs[f'longctx {layout}']:.2e} > {bound:.2e}")
            graphs = {name: capture_graph(fn).replay for name, fn in fns.items()}
            us = interleaved_median_us(graphs, args.rounds)
            floor = 2 * k_tok.numel() * k_tok.element_size() / bw * 1e6
            rows.append((d, b, n, floor, us))
            print(f"  D={d} {b} x {n}: floor {floor:.1f}, "
                  + ", ".join(f"{name} {t:.1f}" for name, t in us.items()), flush=True)
            del graphs, fns, layouts, k_tok, v_tok, k_head, v_head
            torch.cuda.empty_cache()
    names = sorted({x for row in rows for x in row[4]})
    print("\n| D | B x N | floor | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for d, b, n, floor, us in rows:
        print(f"| {d} | {b} x {n} | {floor:.1f} | " + " | ".join(f"{us[x]:.1f}" if x in us else "-" for x in names)
              + " |")


if __name__ == "__main__":
    main()
