"""The split-KV decode kernel at head_dims that are not powers of two: split into two power-of-two
column tiles (`kernels.utils.head_tiles`, the default) against the padded tile of the next power
of two (kernels/decode.py SPLIT_HEADS off) and cuDNN (torch SDPA), on the same GPU: each captured
in a CUDA graph, timed in interleaved rounds with a cold L2 (`launch/bench.py` interleaved_ms).
Each variant is first checked against a float32 reference (max error at most 2x cuDNN's).

    python bench/decode_head_split.py [--dims 96 192] [--dtype fp16]

The decode table's shapes (16/2 heads: 64 x 1024, 8 x 8192, 1 x 65536, 1 x 262144); µs per call
(split kernel + merge, the launch rule's split count).
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

from longctx.kernels import decode as D  # noqa: E402
from longctx.kernels.bandwidth import read_bandwidth  # noqa: E402
from longctx.kernels.utils import device_sms  # noqa: E402

SHAPES = [(64, 1024), (8, 8192), (1, 65536), (1, 262144)]
VARIANTS = {"split": True, "padded": False}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[96, 192])
    ap.add_argument("--dtype", choices=DTYPES, default="fp16")
    ap.add_argument("--heads", type=int, nargs=2, default=[16, 2])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dtype, (hq, hkv) = DTYPES[args.dtype], args.heads
    bw, sms = read_bandwidth(), device_sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, read bandwidth {bw / 1e12:.2f} TB/s; {hq}/{hkv} heads, "
          f"{args.dtype}, µs per call (CUDA graph)")
    torch.manual_seed(0)
    rows = []
    for d in args.dims:
        print(f"D={d}: split tiles {D.head_tiles(d)}, padded ({triton.next_power_of_2(d)}, 0)")
        for b, n in SHAPES:
            q = torch.randn(b, hq, d, device="cuda", dtype=dtype)
            k, v = (torch.randn(b, n, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
            lens = torch.full((b,), n, device="cuda", dtype=torch.int32)
            splits = D.choose_num_splits(b, hkv, n, sms)
            k_t, v_t = (x.transpose(1, 2).contiguous() for x in (k, v))
            # float32 reference over the same cache: [B, Hq, 1, D]
            ref = F.scaled_dot_product_attention(q[:, :, None].float(), k_t.float(), v_t.float(),
                                                 enable_gqa=True)[:, :, 0]

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q[:, :, None], k_t, v_t,
                                                          enable_gqa=True)[:, :, 0]

            err_cudnn = (cudnn().float() - ref).abs().max().item()
            graphs = {}
            for name, split in VARIANTS.items():
                D.SPLIT_HEADS = split  # read when the launch is built: at capture
                try:
                    def fn():
                        return D.flash_decode(q, k, v, lens, None, d ** -0.5, splits)[0]
                    err = (fn().float() - ref).abs().max().item()
                    if err > 2 * err_cudnn + 1e-6:
                        raise SystemExit(f"D={d} {b} x {n} {name}: error {err:.2e}, "
                                         f"cuDNN's {err_cudnn:.2e}")
                    graphs[name] = capture_graph(fn).replay
                finally:
                    D.SPLIT_HEADS = True
            graphs["cuDNN"] = capture_graph(cudnn).replay
            us = interleaved_median_us(graphs, args.rounds)
            floor = 2 * k.numel() * k.element_size() / bw * 1e6
            rows.append((d, b, n, floor, us))
            print(f"  {b} x {n}: floor {floor:.1f}, "
                  + ", ".join(f"{name} {t:.1f}" for name, t in us.items()), flush=True)
            del q, k, v, k_t, v_t, graphs
            torch.cuda.empty_cache()
    print("\n| D | B x N | floor | split | padded | cuDNN | cuDNN / split | padded / split |")
    print("|---|---|---|---|---|---|---|---|")
    for d, b, n, floor, us in rows:
        print(f"| {d} | {b} x {n} | {floor:.1f} | {us['split']:.1f} | {us['padded']:.1f} | "
              f"{us['cuDNN']:.1f} | {us['cuDNN'] / us['split']:.2f}x | "
              f"{us['padded'] / us['split']:.2f}x |")


if __name__ == "__main__":
    main()
