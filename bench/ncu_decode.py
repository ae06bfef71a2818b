"""Launches the split-KV decode kernel on a bf16 cache and on an fp8 one, each at its launch rule,
twice, for Nsight Compute to profile (a development tool; bench/results/fp8-decode-k-layout-h100.txt
has what it showed). With the regex below the profiled launches are bf16's second and fp8's two:

    ncu -k regex:_decode_split --launch-skip 1 --launch-count 3 --section SpeedOfLight \\
        --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters \\
        -o decode -f python bench/ncu_decode.py --shape 32/4/1x262144
    ncu -i decode.ncu-rep --page source --print-source sass --csv > decode-sass.csv
    python bench/ncu_summary.py decode-sass.csv     # stalls and shared memory by opcode
"""

from __future__ import annotations

import argparse

import torch

from fp8_decode_sweep import bf16_launch, fp8_launch  # (bench/, the script's own directory)
from longctx.fp8 import quantize_kv
from longctx.kernels import decode as D
from longctx.kernels.utils import device_sms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="32/4/1x262144", metavar="HQ/HKV/BxN")
    args = ap.parse_args()
    try:
        hq, hkv, bn = args.shape.split("/")
        hq, hkv, (B, N) = int(hq), int(hkv), map(int, bn.split("x"))
    except ValueError:
        ap.error(f"--shape takes HQ/HKV/BxN (e.g. 32/4/1x262144), got {args.shape!r}")
    sms = device_sms(torch.device("cuda"))
    q = torch.randn(B, hq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, N, hkv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
    sp, cfg = bf16_launch(D, B, hkv, N, sms, q.device)
    for _ in range(2):
        D.flash_decode_partials(q, k, v, lens, None, 128 ** -0.5, sp, config=cfg)
    (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    sp8, cfg8 = fp8_launch(D, B, hkv, N, sms, q.device)
    for _ in range(2):
        D.flash_decode_partials(q, k8, v8, lens, None, 128 ** -0.5, sp8, config=cfg8,
                                k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    print(f"{args.shape}: bf16 {sp} splits {cfg}, fp8 {sp8} splits {cfg8}")


if __name__ == "__main__":
    main()
