"""Compile the Gluon Hopper attention kernel for sm_90 without a GPU and inspect it.

Run from /work/main:  .venv/bin/python bench/experiments/gluon_fa_hopper/compile_offline.py [config ...]
Prints per config: success, #wgmma / wait_group values in the PTX, the loop's op order,
ptxas registers and spill stores/loads (bundled ptxas, -arch=sm_90a -v).
Writes the ttgir / ptx to bench/experiments/gluon_fa_hopper/out/<config>.{ttgir,ptx}.
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


def compile_config(name, dtype_str="bf16"):
    BLOCK_N, NUM_STAGES, SCHED = fa_hopper.CONFIGS[name]
    gdt = gl.bfloat16 if dtype_str == "bf16" else gl.float16
    fn = fa_hopper._fa_fwd_hopper_kernel
    const = dict(BLOCK_M=128, BLOCK_N=BLOCK_N, HEAD_DIM=128, NUM_STAGES=NUM_STAGES, SCHED=SCHED)
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
    for c in const:
        sig[c] = "constexpr"
    src = GluonASTSource(fn, sig, const)
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
    bindir = os.path.dirname(PTXAS)
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        cub = os.path.join(d, "k.cubin")
        subprocess.run([PTXAS, "-arch=sm_90a", p, "-o", cub], capture_output=True, text=True)
        sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", cub], capture_output=True,
                              text=True).stdout
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


def main():
    names = sys.argv[1:] or list(fa_hopper.CONFIGS)
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    for name in names:
        print(f"===== {name}: BLOCK_N, NUM_STAGES, SCHED = {fa_hopper.CONFIGS[name]} =====")
        try:
            k = compile_config(name)
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
        print()


if __name__ == "__main__":
    main()
