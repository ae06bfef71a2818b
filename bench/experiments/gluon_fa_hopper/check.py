"""GPU check of the Gluon Hopper attention spike (needs an sm_90 GPU).

Run from the repo root:  python bench/experiments/gluon_fa_hopper/check.py [--quick] [--extra CONFIG]
(a) correctness, causal and non-causal, against an fp32 torch reference, next to
    longctx.attention's errors: brief_w0_n128_s2 in both grid orders on S = 128, 256, 384
    (1, 2, 3 KV tiles for the last query tile; causal query tile 0 takes the 2-tile dummy path),
    GQA 8/2 and 4/4, bf16 and fp16, plus two longer shapes; every other config of
    fa_hopper.CONFIGS non-causal on three shapes.
(b) (printed inside (c), once per kernel specialisation) compiled kernels as launched:
    registers / spills and whether their SASS still puts the softmax exp2 between HGMMAs
    (compile_offline.overlap_blocks on the launched cubin).
(c) timing, bf16, B=1, D=128, (Hq, Hkv) = (16, 2) x S in 4096, 16384, 65536 and (32, 32) x S in
    4096, 16384, causal and not: cuDNN SDPA, longctx.attention and brief_w0_n128_s2
    (query tiles first "qf"; causal also heads first "hf"; --extra CONFIG adds one more config,
    non-causal only unless it has a causal path). Variants are interleaved: 3 rounds of
    [cudnn, longctx, gluon...] per case; reported: the median over rounds of each round's
    median (triton.testing.do_bench, rep=50 ms, L2 flushed before every call; calls longer
    than 20 ms, i.e. S = 65536: 1 warm-up + 3 timed calls with events, same flush).
    TFLOPS = 4*B*Hq*S*S*D / t, halved for causal. Host launch overhead is inside the times
    (as in the earlier runs). --quick: correctness, kernel report and only S = 16384.
Every variant is wrapped in try/except so one failure does not hide the other numbers.
Expected runtime on an H100 (not measured): ~2 min, mostly kernel compiles (~40 Gluon
specialisations, ~1 s each, plus longctx's); the timed loops themselves take ~20-30 s.
"""
import math
import os
import statistics
import sys
import time
import traceback

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fa_hopper  # noqa: E402

try:
    import compile_offline  # ptxas / nvdisasm helpers (bundled with triton)
except Exception as e:  # noqa: BLE001
    compile_offline = None
    print("import compile_offline failed:", repr(e))

try:
    import longctx
except Exception as e:  # noqa: BLE001
    longctx = None
    print("import longctx failed:", repr(e))

DEV = "cuda"
QUICK = "--quick" in sys.argv
EXTRA = sys.argv[sys.argv.index("--extra") + 1] if "--extra" in sys.argv else None
MAIN = "brief_w0_n128_s2"
ROUNDS = 3
REP_MS = 50
LONG_CALL_MS = 20.0


def short(e):
    msg = str(e).strip().splitlines()
    return f"FAILED {type(e).__name__}: {msg[-1] if msg else ''}"[:300]


def reference(q, k, v, scale, causal):
    """fp32 reference: o [B,S,Hq,D] fp32, lse [B,Hq,S] fp32 (natural log)."""
    B, S, Hq, D = q.shape
    g = Hq // k.shape[2]
    qf = q.float().transpose(1, 2)                                   # [B,Hq,S,D]
    kf = k.float().transpose(1, 2).repeat_interleave(g, dim=1)       # [B,Hq,S,D]
    vf = v.float().transpose(1, 2).repeat_interleave(g, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale               # [B,Hq,S,S]
    if causal:
        keep = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
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


# --------------------------------------------------------------------------------------------
# (a) correctness
# --------------------------------------------------------------------------------------------
def check_correctness():
    print("=" * 110)
    print("(a) correctness vs fp32 reference: max |o - o_ref|, max |lse - lse_ref|; 'ok' = finite and")
    print("    within 1.5x longctx.attention's error + (1e-3 on o, 1e-4 on lse)")
    bf, fp = torch.bfloat16, torch.float16
    shapes = [(1, S, hq, hkv, dt) for S in (128, 256, 384) for (hq, hkv) in ((8, 2), (4, 4)) for dt in (bf, fp)]
    shapes += [(2, 1024, 8, 8, bf), (1, 1536, 8, 2, fp)]
    hf_shapes = {(1, 384, 8, 2, bf), (1, 256, 4, 4, fp), (2, 1024, 8, 8, bf), (1, 1536, 8, 2, fp)}
    others_shapes = {(1, 128, 8, 2, bf), (1, 384, 8, 2, bf), (2, 1024, 8, 8, bf)}
    n_bad = 0
    for shape in shapes:
        B, S, Hq, Hkv, dtype = shape
        q, k, v = make(B, S, Hq, Hkv, dtype)
        scale = 1.0 / math.sqrt(128)
        for causal in (False, True):
            o_ref, lse_ref = reference(q, k, v, scale, causal)
            print(f"-- B={B} S={S} Hq={Hq} Hkv={Hkv} {str(dtype).replace('torch.', '')} causal={causal}")
            variants = [(MAIN, True)]
            if shape in hf_shapes:
                variants.append((MAIN, False))
            if shape in others_shapes and not causal:
                variants += [(n, True) for n in fa_hopper.CONFIGS if n != MAIN]
            lc = None
            if longctx is not None:
                try:
                    o, lse = longctx.attention(q, k, v, causal=causal, return_lse=True)
                    torch.cuda.synchronize()
                    lc = errs(o, lse, o_ref, lse_ref)
                    print(f"   {'longctx.attention':<34} o {lc[0]:.3e}   lse {lc[1]:.3e}   finite={lc[2]}")
                except Exception as e:  # noqa: BLE001
                    print(f"   {'longctx.attention':<34} {short(e)}")
            for name, m_fastest in variants:
                label = f"gluon {name} {'qf' if m_fastest else 'hf'}"
                try:
                    t0 = time.time()
                    o, lse = fa_hopper.gluon_attention(q, k, v, config=name, causal=causal, m_fastest=m_fastest)
                    torch.cuda.synchronize()
                    eo, el, fin = errs(o, lse, o_ref, lse_ref)
                    ok = fin and (lc is None or (eo <= 1.5 * lc[0] + 1e-3 and el <= 1.5 * lc[1] + 1e-4))
                    n_bad += not ok
                    print(f"   {label:<34} o {eo:.3e}   lse {el:.3e}   finite={fin}   {'ok' if ok else 'BAD'}"
                          f"   ({time.time() - t0:.1f}s incl. compile)")
                except Exception as e:  # noqa: BLE001
                    n_bad += 1
                    print(f"   {label:<34} {short(e)}")
                    if os.environ.get("VERBOSE"):
                        traceback.print_exc()
        del q, k, v
    print(f"correctness: {n_bad} bad / failed gluon rows")


# --------------------------------------------------------------------------------------------
# (b) compiled kernels as launched
# --------------------------------------------------------------------------------------------
def kernel_report(label, kernel):
    """Registers / spills of the launched kernel and, from its own cubin (nvdisasm), the blocks
    where exp2 sit between HGMMAs with no wgmma wait: offline, brief_w0_n128_s2 shows two
    such blocks (the peeled tile 0 and the loop), each (8 HGMMA, 64-65 MUFU.EX2)."""
    try:
        line = f"   {label:<44} regs {kernel.n_regs} spills {kernel.n_spills}"
        if compile_offline is not None:
            trace, _ = compile_offline.cubin_trace(kernel.asm["cubin"])
            ov = compile_offline.overlap_blocks(trace)
            line += f"  overlap blocks (HGMMA, EX2): {[(h, m) for _, h, m in ov] or 'NONE'}"
        print(line)
    except Exception as e:  # noqa: BLE001
        print(f"   {label:<44} report {short(e)}")


# --------------------------------------------------------------------------------------------
# (c) timing
# --------------------------------------------------------------------------------------------
def sdpa_cudnn(q, k, v, causal):
    from torch.nn.attention import sdpa_kernel, SDPBackend
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = q.shape[2] != k.shape[2]

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)
    return run


def bench(fn):
    """Median ms of fn. Short calls: do_bench (rep=REP_MS). Long calls (> LONG_CALL_MS): do_bench
    would spend 5 estimate + >= 2 more calls; here 1 warm-up + 3 timed calls (L2 flushed)."""
    fn()
    torch.cuda.synchronize()
    cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    triton.runtime.driver.active.clear_cache(cache)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    est = s.elapsed_time(e)
    if est <= LONG_CALL_MS:
        return triton.testing.do_bench(fn, warmup=10, rep=REP_MS, return_mode="median")
    times = [est]
    for _ in range(max(2, int(REP_MS / est))):
        triton.runtime.driver.active.clear_cache(cache)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def check_timing():
    print("=" * 110)
    print("(c) timing, bf16, B=1, D=128: median over rounds of per-round medians (ms), TFLOPS (causal halved),")
    print(f"    {ROUNDS} interleaved rounds per case; spread = (max - min) / median of the round medians")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    seqs = (16384, ) if QUICK else (4096, 16384, 65536)
    cases = [(16, 2, S, c) for S in seqs for c in (False, True)]
    cases += [(32, 32, S, c) for S in seqs if S <= 16384 for c in (False, True)]
    extra_causal = EXTRA is not None and fa_hopper.supports_causal(EXTRA)
    reported = set()
    summary = {}
    for (Hq, Hkv, S, causal) in cases:
        q, k, v = make(1, S, Hq, Hkv, torch.bfloat16, seed=1)
        flops = 4.0 * Hq * S * S * 128 * (0.5 if causal else 1.0)
        lib_mf = fa_hopper.default_m_fastest(causal, S, 128, torch.bfloat16)
        variants = [("cudnn sdpa", sdpa_cudnn(q, k, v, causal))]
        if longctx is not None:
            variants.append(("longctx.attention", lambda: longctx.attention(q, k, v, causal=causal)))
        orders = (True, False) if causal else (True, )
        for mf in orders:
            variants.append((f"gluon {MAIN} {'qf' if mf else 'hf'}",
                             lambda mf=mf: fa_hopper.gluon_attention(q, k, v, config=MAIN, causal=causal,
                                                                     m_fastest=mf)))
        if EXTRA is not None and (not causal or extra_causal):
            variants.append((f"gluon {EXTRA} qf", lambda: fa_hopper.gluon_attention(
                q, k, v, config=EXTRA, causal=causal, m_fastest=True)))
        head = f"Hq={Hq} Hkv={Hkv} S={S} causal={causal} (library grid order here: {'qf' if lib_mf else 'hf'})"
        print(f"-- {head}")
        # one checked call per gluon variant: output vs longctx, compiled kernel as launched
        ref = None
        if longctx is not None:
            try:
                ref = longctx.attention(q, k, v, causal=causal, return_lse=True)
            except Exception as e:  # noqa: BLE001
                print(f"   longctx reference call {short(e)}")
        for vname, fn in variants:
            if not vname.startswith("gluon"):
                continue
            try:
                o, lse = fn()
                torch.cuda.synchronize()
                if ref is not None:
                    do = (o.float() - ref[0].float()).abs().max().item()
                    dl = (lse - ref[1]).abs().max().item()
                    print(f"   {vname:<34} vs longctx: max |do| {do:.3e}  max |dlse| {dl:.3e}")
                key = (vname, Hq // Hkv == 1, causal)
                if key not in reported:
                    reported.add(key)
                    kernel_report(f"{vname} {'g1' if Hq == Hkv else 'gqa'} kernel", fa_hopper.LAST_KERNEL)
            except Exception as e:  # noqa: BLE001
                print(f"   {vname:<34} check call {short(e)}")
        del ref
        times = {vname: [] for vname, _ in variants}
        for _ in range(ROUNDS):
            for vname, fn in variants:
                try:
                    times[vname].append(bench(fn))
                except Exception as e:  # noqa: BLE001
                    times[vname].append(None)
                    print(f"   {vname}: {short(e)}")
        base = None
        for vname, _ in variants:
            ts = [t for t in times[vname] if t is not None]
            if not ts:
                print(f"   {vname:<34} FAILED")
                continue
            med = statistics.median(ts)
            if vname == "cudnn sdpa":
                base = med
            spread = (max(ts) - min(ts)) / med
            rel = f"  x{base / med:.3f} cudnn" if base else ""
            print(f"   {vname:<34} {med:9.3f} ms {flops / med / 1e9:7.1f} TF   spread {100 * spread:4.1f}%"
                  f"   rounds [{', '.join(f'{t:.3f}' for t in ts)}]{rel}")
            summary.setdefault((Hq, Hkv, S, causal, "qf" if lib_mf else "hf"), {})[vname] = flops / med / 1e9
        del q, k, v
        torch.cuda.empty_cache()
    names = []
    for row in summary.values():
        names += [n for n in row if n not in names]
    short_names = [n.replace("gluon ", "").replace(".attention", "").replace(" sdpa", "") for n in names]
    print("summary, TFLOPS (lib order = the library's grid order for the case):")
    print(f"   {'Hq/Hkv   S      causal lib order':<34}" + "".join(f"{n:>22}" for n in short_names))
    for (Hq, Hkv, S, causal, lib), row in summary.items():
        cells = "".join(f"{row[n]:22.1f}" if n in row else f"{'-':>22}" for n in names)
        print(f"   {f'{Hq}/{Hkv}':<8} {S:<6} {causal!s:<6} {lib:<10}" + cells)


if __name__ == "__main__":
    assert torch.cuda.is_available(), "needs a CUDA GPU (sm_90)"
    print("capability:", torch.cuda.get_device_capability(), " args:", sys.argv[1:])
    t0 = time.time()
    try:
        check_correctness()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    print(f"[{time.time() - t0:.1f}s]")
    try:
        check_timing()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    print(f"total {time.time() - t0:.1f}s")
