"""The Gluon prefill kernel at head_dims that are not powers of two: split into two power-of-two
column tiles (kernels/prefill_hopper.py `head_tiles`, the default) against the padded tile of the
next power of two (SPLIT_HEADS off) and cuDNN (torch SDPA), on the same GPU in interleaved rounds
(`launch/bench.py` interleaved_ms, cold L2). Each variant is first checked against a float64
reference: its error at most 2x the plain PyTorch bf16 one (the tests' rule).

    python bench/prefill_head_split.py [--dims 96 192 80 160] [--seq 16384] [--heads 32]

Prints TFLOPS (causal halved) per head_dim, causal / full, and the ratios.
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
from bench import interleaved_ms  # noqa: E402

from longctx.kernels import prefill_hopper as H  # noqa: E402
from longctx.reference import reference_attention  # noqa: E402

VARIANTS = {"padded": False, "split": True}


def gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, split: bool,
          q_start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon kernel with the head split on or off (q/k/v [B, S, H, D])."""
    H.SPLIT_HEADS = split
    try:
        return H.hopper_attention_fwd(q, k, v, softmax_scale=q.shape[-1] ** -0.5,
                                      causal=causal, q_start=q_start)
    finally:
        H.SPLIT_HEADS = True


def check(d: int, causal: bool) -> str:
    """Both variants against float64 on 2 ragged sequences of 1000 rows (1077 keys), 6/2 heads."""
    q = torch.randn(2, 1000, 6, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 1077, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kw = dict(causal=causal, softmax_scale=d ** -0.5, q_start=77 if causal else 0)
    o_ref, lse_ref = reference_attention(q, k, v, compute_dtype=torch.float64, **kw)
    o_bf16, _ = reference_attention(q, k, v, compute_dtype=torch.bfloat16, **kw)
    e_torch = (o_bf16.double() - o_ref).abs().max().item()
    cells = [f"torch bf16 {e_torch:.2e}"]
    for name, split in VARIANTS.items():
        o, lse = gluon(q, k, v, causal, split, kw["q_start"])
        e = (o.double() - o_ref).abs().max().item()
        e_lse = (lse.double() - lse_ref).abs().max().item()
        if not (e <= 2 * e_torch and e_lse < 1e-3):
            raise SystemExit(f"D={d} causal={causal} {name}: error {e:.2e} (lse {e_lse:.1e}) "
                             f"against torch's {e_torch:.2e}")
        cells.append(f"{name} {e:.2e}")
    return ", ".join(cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[96, 192, 80, 160])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
          f"; 1 x {args.seq} rows, {args.heads}/{args.heads} heads, bf16, TFLOPS (causal halved)")
    rows = []
    for d in args.dims:
        print(f"tiles at D={d}: split {H.head_tiles(d)}; padded ({triton.next_power_of_2(d)}, 0)")
        for causal in (True, False):
            print(f"  check {'causal' if causal else 'full'}: {check(d, causal)}")
            q, k, v = (torch.randn(1, args.seq, args.heads, d, device="cuda",
                                   dtype=torch.bfloat16) for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

            fns = {name: (lambda split=split: gluon(q, k, v, causal, split))
                   for name, split in VARIANTS.items()}
            fns["cuDNN"] = cudnn
            times = interleaved_ms(fns, args.rounds, 25, 200)
            flops = 4 * args.seq * args.seq * args.heads * d / (2 if causal else 1)
            tf = {n: flops / (t[len(t) // 2] * 1e-3) / 1e12 for n, t in times.items()}
            rows.append((d, causal, tf))
            print(f"  {'causal' if causal else 'full'}: "
                  + ", ".join(f"{n} {x:.0f}" for n, x in tf.items()), flush=True)
    print("\n| D | causal | split | padded | cuDNN | split / cuDNN | split / padded |")
    print("|---|---|---|---|---|---|---|")
    for d, causal, tf in rows:
        print(f"| {d} | {'yes' if causal else 'no'} | {tf['split']:.0f} | {tf['padded']:.0f} | "
              f"{tf['cuDNN']:.0f} | {tf['split'] / tf['cuDNN']:.2f}x | "
              f"{tf['split'] / tf['padded']:.2f}x |")


if __name__ == "__main__":
    main()
