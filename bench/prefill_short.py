"""Where the Hopper prefill dispatch should switch kernels (needs an sm_90 GPU).

    python bench/prefill_short.py [--quick]

bf16, B=1: the Gluon kernel called directly (`hopper_attention_fwd`, whatever the dispatch rule
says), the Triton kernel (longctx.attention with LONGCTX_PREFILL_KERNEL=triton) and SDPA over
cuDNN, ROUNDS interleaved rounds of launch/bench.py's bench_ms, TFLOPS of the median (causal
FLOPs halved), for the calls near the rule's thresholds in kernels/prefill.py
(`hopper_kernel_applies`: causal from 2048 query rows, no mask from 512 programs of 128 rows):

  * square, D=128, (Hq, Hkv) in (16, 2), (32, 32), 1000-8192 rows (multiples of 128 and not),
    causal or not (the rule was set from the multiples: bench/results/prefill-short-h100.txt);
  * chunked prefill, causal: Sq new rows after 16384 cached keys (q_start = 16384), 16/2;
  * head_dim 64 and 256 at 2048-16384 rows, 16/2, causal or not (the rule sends them to the Gluon
    kernel: _HOPPER_HEAD_DIMS).

The last column says which of the two library kernels won and whether the rule picks it.
"""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import bench_ms  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from longctx.attention import attention  # noqa: E402
from longctx.kernels.prefill import hopper_kernel_applies, prefill_kernel  # noqa: E402
from longctx.kernels.prefill_hopper import hopper_attention_fwd  # noqa: E402

ROUNDS = 3


def shapes(quick: bool) -> list[tuple]:
    """(Hq, Hkv, Sq, Sk, q_start, D, causal)."""
    out = []
    for hq, hkv in [(16, 2), (32, 32)]:
        for n in ([2000, 4000] if quick else [1000, 1024, 1920, 2000, 2048, 3000, 4096, 8192]):
            out += [(hq, hkv, n, n, 0, 128, c) for c in (True, False)]
    for sq in [512, 1000, 2048] if quick else [256, 512, 1000, 2048, 4000]:
        out.append((16, 2, sq, 16384 + sq, 16384, 128, True))
    for d in (64, 256):
        for n in [4000] if quick else [2048, 4000, 16384]:
            out += [(16, 2, n, n, 0, d, c) for c in (True, False)]
    return out


def main() -> None:
    quick = "--quick" in sys.argv
    print(f"{torch.cuda.get_device_name()}, bf16, B=1, TFLOPS (median of {ROUNDS} rounds)")
    print(f"{'Hq/Hkv':>7} {'D':>4} {'Sq':>6} {'Sk':>6} {'q_start':>7} {'causal':>6} {'gluon':>7} "
          f"{'triton':>7} {'cudnn':>7} {'|g-t|':>8}  winner / rule")
    for hq, hkv, sq, sk, q_start, d, causal in shapes(quick):
        q = torch.randn(1, sq, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def gluon():
            return hopper_attention_fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal,
                                        q_start=q_start, k_start=0)[0]

        def triton_():
            with prefill_kernel("triton"):
                return attention(q, k, v, causal=causal, q_start=q_start)

        def cudnn():
            if q_start:  # SDPA's is_causal is the top-left diagonal: the chunk's band as a mask
                mask = (torch.arange(sk, device="cuda")[None, :]
                        <= torch.arange(sq, device="cuda")[:, None] + q_start)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask,
                                                          enable_gqa=hq != hkv)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                      enable_gqa=hq != hkv)

        err = (gluon().float() - triton_().float()).abs().max().item()
        times: dict[str, list[float]] = {"gluon": [], "triton": [], "cudnn": []}
        for _ in range(ROUNDS):
            for name, fn in (("gluon", gluon), ("triton", triton_), ("cudnn", cudnn)):
                try:
                    times[name].append(bench_ms(fn))
                except Exception:  # noqa: BLE001  (cuDNN may refuse a mask or a head_dim)
                    pass
        # FLOPs of the visible (row, key) pairs: causal halves the square; a chunk sees its prefix
        pairs = sq * (q_start + (sq + 1) / 2) if causal else sq * sk
        if causal and not q_start:
            pairs = sq * sk / 2
        flops = 4 * hq * pairs * d
        tf = {n: flops / statistics.median(t) / 1e9 if t else float("nan")
              for n, t in times.items()}
        rule = hopper_kernel_applies(
            dtypes=(q.dtype,) * 3, shapes=(q.shape, k.shape, v.shape),
            strides=(q.stride(), k.stride(), v.stride()),
            data_ptrs=(q.data_ptr(), k.data_ptr(), v.data_ptr()), capability=(9, 0),
            causal=causal, varlen=False, config_given=False)
        winner = "gluon" if tf["gluon"] >= tf["triton"] else "triton"
        agree = (winner == "gluon") == rule
        print(f"{hq:>3}/{hkv:<3} {d:>4} {sq:>6} {sk:>6} {q_start:>7} {causal!s:>6} "
              f"{tf['gluon']:7.0f} {tf['triton']:7.0f} {tf['cudnn']:7.0f} {err:8.1e}  "
              f"{winner} / rule {'gluon' if rule else 'triton'}{'' if agree else '  <-- differs'}",
              flush=True)
        del q, k, v, qt, kt, vt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
