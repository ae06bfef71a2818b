"""Compile the Gluon Hopper attention kernel for sm_90 without a GPU and inspect it.

Run from the repository root:  python bench/experiments/gluon_fa_hopper/compile_offline.py [variant ...]
variant = <config in fa_hopper.CONFIGS>[:causal][:hf][:fp16][:spec][:g1][:NAME=int]  (hf: heads of
one query tile adjacent, M_FASTEST=False; fp16 instead of bf16; spec: the launch's integer /
pointer specialisation for the timed shapes (S, Hq multiples of 16); g1: spec plus GROUP == 1
(Hq == Hkv); NAME=int: another constexpr, e.g. SINGLE=1);
default: every config non-causal plus brief_w0_n128_s2 heads-first / causal / fp16 / S == 128.
Prints per config: success, #wgmma / wait_group values in the PTX, the loop's op order,
ptxas registers and spill stores/loads (bundled ptxas, -arch=sm_90a -v).
Writes the ttgir / ptx / sass to bench/experiments/gluon_fa_hopper/out/<variant, ':' -> '_'>.*.
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

import fa_hopper  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def desc_sig(dtype_str, block, gl_dtype):
    layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
    return f"tensordesc<{dtype_str}[{block[0]}, {block[1]}],{layout!r}>"


def parse_variant(spec):
    """'<config>[:causal][:hf][:fp16][:NAME=int]...' -> (config, causal, m_fastest, extra constexprs).
    hf = heads first (M_FASTEST=False); fp16 instead of bf16; NAME=int sets another constexpr
    of the kernel (e.g. SINGLE=1: the S == 128 specialisation)."""
    parts = spec.split(":")
    name, flags = parts[0], parts[1:]
    assert name in fa_hopper.CONFIGS, f"unknown config {name}"
    extra = {}
    for f in flags:
        if "=" in f:
            key, val = f.split("=", 1)
            extra[key] = int(val)
        else:
            assert f in ("causal", "hf", "fp16", "spec", "g1"), f"unknown flag {f}"
    return name, "causal" in flags, "hf" not in flags, extra


def variant_dtype(spec):
    return "fp16" if "fp16" in spec.split(":")[1:] else "bf16"


def compile_config(spec, dtype_str="bf16"):
    name, causal, m_fastest, extra = parse_variant(spec)
    BLOCK_N, NUM_STAGES, SCHED = fa_hopper.CONFIGS[name]
    gdt = gl.bfloat16 if dtype_str == "bf16" else gl.float16
    fn = fa_hopper._fa_fwd_hopper_kernel
    const = dict(BLOCK_M=128, BLOCK_N=BLOCK_N, HEAD_DIM=128, NUM_STAGES=NUM_STAGES, SCHED=SCHED,
                 CAUSAL=causal, M_FASTEST=m_fastest, **extra)
    sig = {
        "q_desc": desc_sig(dtype_str, [128, 128], gdt),
        "k_desc": desc_sig(dtype_str, [BLOCK_N, 128], gdt),
        "v_desc": desc_sig(dtype_str, [BLOCK_N, 128], gdt),
        "o_desc": desc_sig(dtype_str, [128, 128], gdt),
        "LSE": "*fp32",
        "qk_scale": "fp32",
        "S": "i32",
        "H_Q": "i32",
        "GROUP": "i32",
    }
    flags = spec.split(":")[1:]
    attrs = {}
    if "spec" in flags or "g1" in flags:
        # what a launch with the timed shapes specialises on (triton's JIT: ints divisible by
        # 16 and 16-byte aligned pointers get tt.divisibility=16, an int equal to 1 becomes a
        # constant): LSE aligned, S and H_Q multiples of 16; g1: GROUP == 1 (Hq == Hkv).
        for a in ("LSE", "S", "H_Q"):
            attrs[(fn.arg_names.index(a), )] = [["tt.divisibility", 16]]
        if "g1" in flags:
            const["GROUP"] = 1
    for c in const:
        sig[c] = "constexpr"
    src = GluonASTSource(fn, sig, const, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=1))
    return k


def ptxas_info(ptx):
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", p, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    txt = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", txt)
    st = re.search(r"(\d+) bytes spill stores", txt)
    ld = re.search(r"(\d+) bytes spill loads", txt)
    return (int(regs.group(1)) if regs else None, int(st.group(1)) if st else None,
            int(ld.group(1)) if ld else None, txt)


def loop_trace(ptx):
    """Order of interesting instructions, one letter per op, with loop labels."""
    out = []
    for line in ptx.splitlines():
        s = line.strip()
        if re.match(r"^\$L__BB\d+_\d+:", s):
            out.append(f"\n  {s}")
        elif s.startswith("wgmma.mma_async"):
            shape = re.search(r"m64n(\d+)k16", s).group(1)
            a_reg = s.split("}", 1)[1].lstrip(" ,").startswith("{")
            out.append(f"MMA(n{shape},{'A=reg' if a_reg else 'A=smem'})")
        elif s.startswith("wgmma.commit_group"):
            out.append("commit")
        elif s.startswith("wgmma.wait_group"):
            out.append("WAIT(" + re.search(r"wait_group\.sync\.aligned\s+(\d+)", s).group(1) + ")")
        elif s.startswith("ex2.approx"):
            if not out or not out[-1].startswith("ex2"):
                out.append("ex2x1")
            else:
                n = int(out[-1][4:]) + 1
                out[-1] = f"ex2x{n}"
        elif s.startswith("bar.sync") or s.startswith("barrier.sync"):
            out.append("BAR")
        elif "cp.async.bulk.tensor" in s:
            out.append("TMA_st" if "shared::cta.global" not in s and ".global.shared" in s else "TMA")
        elif s.startswith("mbarrier.try_wait") or "mbarrier.try_wait" in s:
            out.append("mbar_wait")
        elif s.startswith("@") and "bra" in s:
            out.append("bra")
    return " ".join(out)


def sass_trace(ptx):
    """ptxas + nvdisasm: condensed SASS order of HGMMA / DEPBAR / MUFU.EX2 / barriers.
    ptxas reschedules: this, not the PTX, says where the waits really are."""
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        cub = os.path.join(d, "k.cubin")
        subprocess.run([PTXAS, "-arch=sm_90a", p, "-o", cub], capture_output=True, text=True)
        with open(cub, "rb") as f:
            return cubin_trace(f.read())


def cubin_trace(cubin):
    """sass_trace of a cubin (bytes), e.g. a launched kernel's kernel.asm["cubin"]."""
    with tempfile.TemporaryDirectory() as d:
        cub = os.path.join(d, "k.cubin")
        with open(cub, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([os.path.join(os.path.dirname(PTXAS), "nvdisasm"), "-c", cub],
                              capture_output=True, text=True).stdout
    toks = []
    for line in sass.splitlines():
        m = re.search(r"(HGMMA\.\S+|WARPGROUP\.DEPBAR\.LE gsb0, 0x\d|MUFU\.EX2|BAR\.SYNC|"
                      r"SYNCS\.PHASECHK|UTMALDG|UTMASTG|^\.L_x_\d+:)", line.strip())
        if m:
            t = m.group(1).replace("WARPGROUP.DEPBAR.LE gsb0, 0x", "DEPBAR").replace(".F32.BF16", "")
            t = t.replace(".F32.F16", "").replace(".DEFER_BLOCKING", "").replace("SYNCS.PHASECHK", "mbar_wait")
            if t.startswith(".L_x_"):
                t = "\n  " + t
            if toks and toks[-1][1] == t:
                toks[-1][0] += 1
            else:
                toks.append([1, t])
    return " ".join((f"{n}x{t}" if n > 1 else t) for n, t in toks), sass


def overlap_blocks(trace):
    """Blocks of a sass_trace in which MUFU.EX2 sit between HGMMAs with no DEPBAR (wgmma wait)
    in between: [(label, #HGMMA, #MUFU.EX2 between the first and the last of those HGMMAs)].
    Only windows with >= 4 HGMMAs and >= 16 exp2 count (the intended softmax/GEMM overlap)."""
    out = []
    for line in trace.split("\n"):
        toks = line.split()
        label = toks[0] if toks and toks[0].startswith(".L_x_") else "entry"
        windows, cur = [], []
        for t in toks:
            if "DEPBAR" in t:
                windows.append(cur)
                cur = []
            else:
                cur.append(t)
        windows.append(cur)
        for w in windows:
            idx = [i for i, t in enumerate(w) if "HGMMA" in t]
            if len(idx) < 2:
                continue
            seg = w[idx[0]:idx[-1] + 1]
            cnt = lambda key: sum(int(t.split("x", 1)[0]) if re.match(r"^\d+x", t) else 1  # noqa: E731
                                  for t in seg if key in t)
            nh, nm = cnt("HGMMA"), cnt("MUFU.EX2")
            if nh >= 4 and nm >= 16:
                out.append((label, nh, nm))
    return out


DEFAULT_VARIANTS = list(fa_hopper.CONFIGS) + [
    "brief_w0_n128_s2:hf", "brief_w0_n128_s2:causal", "brief_w0_n128_s2:causal:hf",
    "brief_w0_n128_s2:causal:fp16", "brief_w0_n128_s2:SINGLE=1", "brief_w0_n128_s2:causal:SINGLE=1",
    # as launched by check.py's timing: 16/2 (GROUP 8) and 32/32 (GROUP 1), both grid orders
    "brief_w0_n128_s2:spec", "brief_w0_n128_s2:g1",
    "brief_w0_n128_s2:causal:spec", "brief_w0_n128_s2:causal:hf:spec",
    "brief_w0_n128_s2:causal:g1", "brief_w0_n128_s2:causal:hf:g1",
]


def main():
    names = sys.argv[1:] or DEFAULT_VARIANTS
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    for spec in names:
        cfg, causal, m_fastest, extra = parse_variant(spec)
        name = spec.replace(":", "_").replace("=", "")
        print(f"===== {spec}: BLOCK_N, NUM_STAGES, SCHED = {fa_hopper.CONFIGS[cfg]}, CAUSAL={causal}, "
              f"M_FASTEST={m_fastest}, dtype={variant_dtype(spec)}"
              f"{''.join(f', {k}={v}' for k, v in extra.items())} =====")
        try:
            k = compile_config(spec, variant_dtype(spec))
        except Exception as e:  # noqa: BLE001
            print("COMPILE FAILED:", type(e).__name__, str(e)[:3000])
            continue
        ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
        with open(os.path.join(HERE, "out", f"{name}.ptx"), "w") as f:
            f.write(ptx)
        with open(os.path.join(HERE, "out", f"{name}.ttgir"), "w") as f:
            f.write(ttgir)
        waits = re.findall(r"wgmma.wait_group.sync.aligned\s+(\d+)", ptx)
        print("success: True")
        print("shared mem (bytes):", k.metadata.shared)
        print("tensordesc_meta:", getattr(k.metadata, "tensordesc_meta", None))
        print("wgmma.mma_async count:", ptx.count("wgmma.mma_async"),
              " commit_group:", ptx.count("wgmma.commit_group"))
        print("wgmma.wait_group values in PTX order:", waits)
        print("ld.shared / st.shared count (P must not go through smem):",
              len(re.findall(r"\bld\.shared", ptx)), len(re.findall(r"\bst\.shared", ptx)))
        print("triton n_regs / n_spills (from cubin):", getattr(k, "n_regs", None), getattr(k, "n_spills", None))
        regs, st, ld, txt = ptxas_info(ptx)
        print(f"ptxas -arch=sm_90a: registers={regs}, spill stores={st} B, spill loads={ld} B")
        for line in txt.splitlines():
            if "wgmma" in line.lower() or "warning" in line.lower():
                print("  ptxas:", line.strip()[:300])
        print("PTX op trace (MMA = one wgmma.mma_async; with BLOCK_N=64, n64 = QK^T and n128 = PV):")
        print(loop_trace(ptx))
        trace, sass = sass_trace(ptx)
        with open(os.path.join(HERE, "out", f"{name}.sass"), "w") as f:
            f.write(sass)
        print("SASS trace after ptxas (DEPBARn = WARPGROUP.DEPBAR.LE gsb0, n):")
        print(trace)
        ov = overlap_blocks(trace)
        print("blocks with exp2 between HGMMAs and no wgmma wait (label, #HGMMA, #MUFU.EX2):",
              ov if ov else "NONE (no softmax/GEMM overlap)")
        print()


if __name__ == "__main__":
    main()
