"""GPU check of the Gluon Hopper attention spike (needs an sm_90 GPU).

Run from the repo root:  python bench/experiments/gluon_fa_hopper/check.py  [--quick]
(a) correctness of every config in fa_hopper.CONFIGS (bf16, plus one fp16 case) against an
    fp32 torch reference, next to longctx.attention's errors;
(b) timing (triton.testing.do_bench, median) of the configs, longctx.attention and
    torch SDPA (cuDNN backend), non-causal bf16, B=1, D=128.
Every variant is wrapped in try/except so one failure does not hide the other numbers.
"""
import math
import os
import sys
import time
import traceback

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fa_hopper  # noqa: E402

try:
    import longctx
except Exception as e:  # noqa: BLE001
    longctx = None
    print("import longctx failed:", repr(e))

DEV = "cuda"
QUICK = "--quick" in sys.argv


def reference(q, k, v, scale):
    """fp32 reference: o [B,S,Hq,D] fp32, lse [B,Hq,S] fp32 (natural log)."""
    B, S, Hq, D = q.shape
    g = Hq // k.shape[2]
    qf = q.float().transpose(1, 2)                                   # [B,Hq,S,D]
    kf = k.float().transpose(1, 2).repeat_interleave(g, dim=1)       # [B,Hq,S,D]
    vf = v.float().transpose(1, 2).repeat_interleave(g, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale               # [B,Hq,S,S]
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(torch.softmax(s, dim=-1), vf)
    return o.transpose(1, 2).contiguous(), lse


def errs(o, lse, o_ref, lse_ref):
    eo = (o.float() - o_ref).abs().max().item()
    el = (lse.float() - lse_ref).abs().max().item()
    finite = bool(torch.isfinite(o.float()).all().item() and torch.isfinite(lse.float()).all().item())
    return eo, el, finite


def make(B, S, Hq, Hkv, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, S, Hq, 128, device=DEV, dtype=dtype, generator=g)
    k = torch.randn(B, S, Hkv, 128, device=DEV, dtype=dtype, generator=g)
    v = torch.randn(B, S, Hkv, 128, device=DEV, dtype=dtype, generator=g)
    return q, k, v


def check_correctness():
    print("=" * 100)
    print("(a) correctness vs fp32 reference: max |o - o_ref|, max |lse - lse_ref|")
    shapes = [(1, 256, 4, 2, torch.bfloat16), (2, 1024, 8, 8, torch.bfloat16), (1, 512, 8, 2, torch.float16)]
    for (B, S, Hq, Hkv, dtype) in shapes:
        q, k, v = make(B, S, Hq, Hkv, dtype)
        scale = 1.0 / math.sqrt(128)
        o_ref, lse_ref = reference(q, k, v, scale)
        print(f"-- B={B} S={S} Hq={Hq} Hkv={Hkv} {str(dtype).replace('torch.', '')}")
        rows = []
        if longctx is not None:
            try:
                o, lse = longctx.attention(q, k, v, causal=False, return_lse=True)
                torch.cuda.synchronize()
                rows.append(("longctx.attention",) + errs(o, lse, o_ref, lse_ref))
            except Exception as e:  # noqa: BLE001
                rows.append(("longctx.attention", f"FAILED {type(e).__name__}: {e}"))
        for name in fa_hopper.CONFIGS:
            try:
                t0 = time.time()
                o, lse = fa_hopper.gluon_attention(q, k, v, config=name)
                torch.cuda.synchronize()
                rows.append((f"gluon {name}",) + errs(o, lse, o_ref, lse_ref) + (time.time() - t0,))
            except Exception as e:  # noqa: BLE001
                msg = str(e).strip().splitlines()
                rows.append((f"gluon {name}", f"FAILED {type(e).__name__}: {msg[-1] if msg else ''}"[:300]))
                if os.environ.get("VERBOSE"):
                    traceback.print_exc()
        for r in rows:
            if len(r) == 2:
                print(f"   {r[0]:<28} {r[1]}")
            else:
                extra = f"   (first call {r[4]:.1f}s incl. compile)" if len(r) > 4 else ""
                print(f"   {r[0]:<28} o {r[1]:.3e}   lse {r[2]:.3e}   finite={r[3]}{extra}")


def sdpa_cudnn(q, k, v):
    from torch.nn.attention import sdpa_kernel, SDPBackend
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = q.shape[2] != k.shape[2]

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=gqa)
    return run


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100 if not QUICK else 30, return_mode="median")


def check_timing():
    print("=" * 100)
    print("(b) timing, non-causal bf16, B=1, D=128: median ms (do_bench) and TFLOPS = 4*B*Hq*S*S*D/t")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    cases = [(16, 2, 4096), (16, 2, 16384), (32, 32, 4096), (32, 32, 16384)]
    variants = [("cudnn sdpa", None), ("longctx.attention", None)] + [(f"gluon {n}", n) for n in fa_hopper.CONFIGS]
    table = {}
    for (Hq, Hkv, S) in cases:
        q, k, v = make(1, S, Hq, Hkv, torch.bfloat16, seed=1)
        flops = 4.0 * 1 * Hq * S * S * 128
        for vname, cfg in variants:
            try:
                if vname == "cudnn sdpa":
                    fn = sdpa_cudnn(q, k, v)
                elif vname == "longctx.attention":
                    if longctx is None:
                        raise RuntimeError("longctx not importable")
                    fn = lambda: longctx.attention(q, k, v, causal=False)  # noqa: E731
                else:
                    fn = lambda cfg=cfg: fa_hopper.gluon_attention(q, k, v, config=cfg)  # noqa: E731
                ms = bench(fn)
                table[(vname, Hq, Hkv, S)] = f"{ms:8.3f} ms {flops / ms / 1e9:6.1f} TF"
            except Exception as e:  # noqa: BLE001
                msg = str(e).strip().splitlines()
                table[(vname, Hq, Hkv, S)] = f"FAIL {type(e).__name__}"
                print(f"   {vname} Hq={Hq} Hkv={Hkv} S={S}: FAILED {type(e).__name__}: "
                      f"{msg[-1] if msg else ''}"[:300])
        del q, k, v
        torch.cuda.empty_cache()
    hdr = f"{'variant':<26}" + "".join(f"{f'Hq{Hq}/Hkv{Hkv} S={S}':>26}" for (Hq, Hkv, S) in cases)
    print(hdr)
    for vname, _ in variants:
        print(f"{vname:<26}" + "".join(f"{table.get((vname, Hq, Hkv, S), '-'):>26}" for (Hq, Hkv, S) in cases))
    # ratio to cuDNN
    print("ratio to cudnn (time_cudnn / time_variant):")
    for vname, _ in variants[1:]:
        cells = []
        for (Hq, Hkv, S) in cases:
            a, b = table.get(("cudnn sdpa", Hq, Hkv, S), ""), table.get((vname, Hq, Hkv, S), "")
            try:
                cells.append(f"{float(a.split()[0]) / float(b.split()[0]):.3f}")
            except Exception:  # noqa: BLE001
                cells.append("-")
        print(f"{vname:<26}" + "".join(f"{c:>26}" for c in cells))


if __name__ == "__main__":
    assert torch.cuda.is_available(), "needs a CUDA GPU (sm_90)"
    print("capability:", torch.cuda.get_device_capability())
    t0 = time.time()
    try:
        check_correctness()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    try:
        check_timing()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    print(f"total {time.time() - t0:.1f}s")
