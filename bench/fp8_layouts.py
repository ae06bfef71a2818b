"""The fp8 cache's decode kernel on one cache's values in other memory layouts (a development
tool: it chose longctx.fp8.head_major for the model's K and scales). K and the scales in the
usual [B, S, Hkv] layout or head-major ([B, Hkv, S] physically, a strided view); V key-major
(longctx.fp8.key_major_v) with its rows as the model pads them, or padded 128 keys further, or
blocked ([B, Hkv, S / 128, D, 128] physically: each 128-key block's V one run of bytes). The
blocked V is no strided view: it is read by a copy of kernels/decode.py whose V address gains
n_start * (D - 1) (written to a temporary file), with 128-key splits and blocks only.

    python bench/fp8_layouts.py      # needs a CUDA GPU of compute capability >= 8.9

bf16 q, head_dim 128, the key-major launch rule (`fp8_decode_sweep.fp8_launch`); µs per call
(split kernel + merge), CUDA-graph replay with a cold L2 (`launch/bench.py graph_ms`); each
variant's output checked equal to the first's.
"""
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))
from bench import graph_ms, stream_read_ms  # noqa: E402
from fp8_decode_sweep import fp8_launch  # noqa: E402  (this script's folder)

from longctx.fp8 import head_major, key_major_v, quantize_kv  # noqa: E402
from longctx.kernels import decode as D  # noqa: E402
from longctx.kernels.merge import merge_states_triton  # noqa: E402
from longctx.kernels.utils import device_sms  # noqa: E402

T = dict(warmup_ms=10, rep_ms=40)
SHAPES = [(16, 2, 1, 262144), (32, 4, 1, 262144), (64, 8, 1, 262144), (32, 4, 1, 1048576),
          (32, 4, 8, 8192)]
_V_LOAD = "+ offs_d[None, :].to(tl.int64) * stride_vd, mask=v_mask, other=0.0)"


def blocked_kernel_module():
    """kernels/decode.py with V's address for a blocked key-major V (see the docstring)."""
    src = (ROOT / "kernels/decode.py").read_text()
    assert src.count(_V_LOAD) == 1, "kernels/decode.py's key-major V load changed"
    src = src.replace(_V_LOAD, _V_LOAD.replace(" * stride_vd,", " * stride_vd + "
                                               "n_start.to(tl.int64) * (BLOCK_D - 1),"))
    path = Path(tempfile.mkdtemp()) / "decode_blocked_v.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("decode_blocked_v", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def call(mod, q, k, v, lens, splits, cfg, scales):
    o, lse = mod.flash_decode_partials(q, k, v, lens, None, 128**-0.5, splits, config=cfg,
                                       **scales)
    out = merge_states_triton(o, lse, out_dtype=q.dtype)
    return out[0] if isinstance(out, tuple) else out


def copy_head_major(x):
    return head_major(x.shape, x.dtype, x.device).copy_(x)


def copy_key_major(v8, pad=0):
    """v8 [B, S, H, D] as a key-major V whose rows are S + pad keys long (pad 0: key_major_v's)."""
    if pad == 0:
        return key_major_v(v8.shape, v8.device).copy_(v8)
    B, S, H, Dd = v8.shape
    rows = torch.zeros(B, H, Dd, S + pad, dtype=v8.dtype, device=v8.device)[..., :S]
    return rows.permute(0, 3, 1, 2).copy_(v8)


def copy_blocked(v8):
    """v8 [B, S, H, D] (S a multiple of 128) as [B, H, S / 128, D, 128], seen with the strides
    (H S D, 1, S D, 128) the blocked kernel takes (its V address adds the block's offset)."""
    B, S, H, Dd = v8.shape
    buf = v8.reshape(B, S // 128, 128, H, Dd).permute(0, 3, 1, 4, 2).contiguous()
    return buf.as_strided((B, S, H, Dd), (H * S * Dd, 1, S * Dd, 128))


def main() -> None:
    sms = device_sms(torch.device("cuda"))
    blocked = blocked_kernel_module()
    print(torch.cuda.get_device_name())
    for hq, hkv, B, N in SHAPES:
        torch.manual_seed(0)
        q = torch.randn(B, hq, 128, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
        (k8, ks), (v8, vs) = (quantize_kv(torch.randn(B, N, hkv, 128, device="cuda",
                                                      dtype=torch.bfloat16)) for _ in range(2))
        splits, cfg = fp8_launch(D, B, hkv, N, sms, q.device, key_major=True)
        assert cfg[0] == 128 and N % (splits * 128) == 0, "the blocked V needs 128-key splits"
        k_layouts = {"usual": (k8, dict(k_scale=ks, v_scale=vs)),
                     "head-major": (copy_head_major(k8), dict(k_scale=copy_head_major(ks),
                                                              v_scale=copy_head_major(vs)))}
        v_layouts = {"key-major": (D, copy_key_major(v8)),
                     "key-major, rows +128": (D, copy_key_major(v8, 128)),
                     "blocked": (blocked, copy_blocked(v8))}
        ref, rows = None, []
        for kname, (kk, sc) in k_layouts.items():
            for vname, (mod, vv) in v_layouts.items():
                out = call(mod, q, kk, vv, lens, splits, cfg, sc)
                ref = out if ref is None else ref
                assert torch.equal(out, ref), (kname, vname)
                t = graph_ms(lambda: call(mod, q, kk, vv, lens, splits, cfg, sc), **T) * 1e3
                rows.append(f"  K and scales {kname:10s} V {vname:20s} {t:7.1f} us")
        stream = stream_read_ms([k8, v8, ks, vs], **T)[0] * 1e3
        print(f"{hq}/{hkv} {B} x {N}, {splits} splits of {cfg}; a streaming read of the same "
              f"bytes {stream:.1f} us")
        print("\n".join(rows))
        del k_layouts, v_layouts, k8, v8, ks, vs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
