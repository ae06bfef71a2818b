"""Where the decode kernel's time goes at one long sequence, bf16 cache against fp8 (V key-major,
with K and the scales in the usual [B, S, Hkv] layout and head-major as the model stores them):
the whole call (longctx.decode, its own rule), the split kernel alone, the merge alone, and a
pure streaming read of the same bytes and an empty launch (launch/bench.py stream_read_ms), all
CUDA-graph replays with a cold L2 (launch/bench.py graph_ms). A development tool: it bounds
what the fp8 cache's speed-up over the bf16 cache can be under this timing.

    python bench/fp8_decode_bound.py      # needs a CUDA GPU of compute capability >= 8.9
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from bench import graph_ms, stream_read_ms  # noqa: E402
from fp8_decode_sweep import bf16_launch, fp8_launch  # noqa: E402  (this script's folder)

import longctx  # noqa: E402
from longctx.fp8 import FP8, head_major, key_major_v, quantize_kv  # noqa: E402
from longctx.kernels import decode as D  # noqa: E402
from longctx.kernels.bandwidth import read_bandwidth  # noqa: E402
from longctx.kernels.merge import merge_states_triton  # noqa: E402
from longctx.kernels.utils import device_sms  # noqa: E402

T = dict(warmup_ms=10, rep_ms=40)
SHAPES = [(16, 2, 1, 262144), (32, 4, 1, 262144), (64, 8, 1, 262144), (32, 4, 1, 1048576)]


def main() -> None:
    bw, sms = read_bandwidth(), device_sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, read {bw / 1e12:.2f} TB/s, {sms} SMs")
    empty = torch.empty(1, device="cuda")
    print(f"empty launch {stream_read_ms([empty], **T)[1] * 1e3:.1f} us")
    print("heads B x N | cache | call | split | merge | stream same bytes | floor | "
          "call - stream | splits cfg")
    for hq, hkv, B, N in SHAPES:
        torch.manual_seed(0)
        q = torch.randn(B, hq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, N, hkv, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
        rows = {"bf16": (dict(), k, v, *bf16_launch(D, B, hkv, N, sms, q.device), [k, v])}
        (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
        del k, v
        vkm = key_major_v(v8.shape, q.device)
        vkm.copy_(v8)
        del v8
        launch = fp8_launch(D, B, hkv, N, sms, q.device, key_major=True)
        rows["fp8 key-major V"] = (dict(k_scale=ks, v_scale=vs), k8, vkm, *launch,
                                   [k8, vkm, ks, vs])
        khm = head_major(k8.shape, FP8, q.device)
        khm.copy_(k8)
        kshm, vshm = (head_major(t.shape, t.dtype, q.device).copy_(t) for t in (ks, vs))
        rows["fp8 model layout"] = (dict(k_scale=kshm, v_scale=vshm), khm, vkm, *launch,
                                    [khm, vkm, kshm, vshm])
        for name, (sc, kk, vv, s, c, parts) in rows.items():
            t_call = graph_ms(lambda: longctx.decode(q, kk, vv, cache_seqlens=lens, **sc),
                              **T) * 1e3
            o, lse = D.flash_decode_partials(q, kk, vv, lens, None, 128**-0.5, s, config=c, **sc)
            t_split = graph_ms(lambda: D.flash_decode_partials(q, kk, vv, lens, None, 128**-0.5,
                                                               s, config=c, **sc), **T) * 1e3
            t_merge = graph_ms(lambda: merge_states_triton(o, lse, out_dtype=q.dtype), **T) * 1e3
            t_stream = stream_read_ms(parts, **T)[0] * 1e3
            floor = sum(t.numel() * t.element_size() for t in parts) / bw * 1e6
            print(f"{hq}/{hkv} {B} x {N} | {name} | {t_call:.1f} | {t_split:.1f} | "
                  f"{t_merge:.1f} | {t_stream:.1f} | {floor:.1f} | {t_call - t_stream:.1f} | "
                  f"{s} {c}")
            del o, lse
        del rows, k8, vkm, ks, vs, khm, kshm, vshm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
