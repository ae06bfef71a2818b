"""Compile the warp-specialized Gluon kernel (fa_ws.py) for sm_90a without a GPU and inspect it.

Run from the repository root:
    .venv/bin/python bench/experiments/gluon_fa_hopper_ws/compile_ws.py [variant ...]
variant = <config in fa_ws.CONFIGS>[:fp16][:spec][:g1][:NAME=int]
  fp16: fp16 instead of bf16; spec: the launch's integer specialisation for the timed shapes
  (LSE aligned, SEQ and H_Q multiples of 16); g1: spec plus GROUP == 1 (Hq == Hkv);
  NAME=int: override a constexpr (e.g. CONSUMER_REGS=232).
Default: every config, plus ws_n128_s2 with :spec, :g1 and :fp16.

Per variant: shared memory, setmaxnreg values in the PTX (per partition), ptxas registers (the
kernel-wide .maxnreg; the partitions run under their setmaxnreg limits) and spills, the highest
register each partition's SASS touches, and the SASS overlap evidence:
  * "EX2 under wgmma": MUFU.EX2 executed while >= 1 wgmma group of the same warpgroup is still
    pending (issued, HGMMA ... gsb0, and not yet retired by a WARPGROUP.DEPBAR.LE gsb0, n with n
    below the pending count), counted along the straight-line SASS order of each block.
    FA3's order retires S_{j+1} with DEPBAR 1 and runs the softmax under P_j V_j: ~64 EX2 per
    tile with BLOCK_N = 128 (64 rows x 128 keys / 128 threads) is the full overlap;
  * the condensed SASS trace of the consumer main loop.
Writes ttgir / ptx / sass to bench/experiments/gluon_fa_hopper_ws/out/<variant>.*.
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

import fa_ws  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def desc_sig(dtype_str, block, gl_dtype):
    layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
    return f"tensordesc<{dtype_str}[{block[0]}, {block[1]}],{layout!r}>"


def parse_variant(spec):
    parts = spec.split(":")
    name, flags = parts[0], parts[1:]
    assert name in fa_ws.CONFIGS, f"unknown config {name}"
    extra = {}
    for f in flags:
        if "=" in f:
            key, val = f.split("=", 1)
            extra[key] = int(val)
        else:
            assert f in ("fp16", "spec", "g1"), f"unknown flag {f}"
    return name, [f for f in flags if "=" not in f], extra


def compile_variant(spec):
    name, flags, extra = parse_variant(spec)
    dtype_str = "fp16" if "fp16" in flags else "bf16"
    gdt = gl.float16 if dtype_str == "fp16" else gl.bfloat16
    const = fa_ws.constexprs(name)
    const.update(extra)
    fn = fa_ws._fa_ws_kernel
    BN = const["BLOCK_N"]
    sig = {
        "q_desc": desc_sig(dtype_str, [64, 128], gdt),
        "k_desc": desc_sig(dtype_str, [BN, 128], gdt),
        "v_desc": desc_sig(dtype_str, [BN, 128], gdt),
        "o_desc": desc_sig(dtype_str, [64, 128], gdt),
        "LSE": "*fp32",
        "qk_scale": "fp32",
        "SEQ": "i32",
        "H_Q": "i32",
        "GROUP": "i32",
    }
    attrs = {}
    if "spec" in flags or "g1" in flags:
        for a in ("LSE", "SEQ", "H_Q"):
            attrs[(fn.arg_names.index(a), )] = [["tt.divisibility", 16]]
        if "g1" in flags:
            const["GROUP"] = 1
    for c in const:
        sig[c] = "constexpr"
    src = GluonASTSource(fn, sig, const, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=1))


def ptxas(ptx):
    """(registers, spill stores, spill loads, log, cubin bytes) of ptxas -v --gpu-name=sm_90a."""
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        cub = os.path.join(d, "k.cubin")
        r = subprocess.run([os.path.join(BIN, "ptxas"), "-lineinfo", "-v", "--gpu-name=sm_90a", p, "-o", cub],
                           capture_output=True, text=True)
        txt = r.stdout + r.stderr
        cubin = open(cub, "rb").read() if os.path.exists(cub) else b""
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, txt)) else None  # noqa: E731
    return (num(r"Used (\d+) registers"), num(r"(\d+) bytes spill stores"), num(r"(\d+) bytes spill loads"),
            txt, cubin)


def disassemble(cubin):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", path], capture_output=True,
                              text=True).stdout


def sass_instrs(sass):
    """[(label or None, instruction text)] in address order."""
    out, label = [], None
    for line in sass.splitlines():
        s = line.strip()
        if m := re.match(r"^(\.L_x_\d+):", s):
            label = m.group(1)
            out.append((label, None))
        elif m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line):
            out.append((None, m.group(1)))
    return out


def partitions(instrs):
    """Split the SASS into regions that start at a USETMAXREG (setmaxnreg) and record, per region,
    the setmaxnreg value, the highest general register used, and #HGMMA / #UTMALDG / #MUFU.EX2.
    Regions are in address order; a region ends at the next USETMAXREG."""
    regions, cur = [], None
    for label, ins in instrs:
        if ins is None:
            continue
        if "USETMAXREG" in ins:
            val = int(re.search(r"0x([0-9a-f]+)", ins).group(1), 16)
            cur = dict(setmaxnreg=val, kind=ins.split()[0].split(".")[1], max_reg=-1, hgmma=0, tma=0,
                       ex2=0, n=0)
            regions.append(cur)
            continue
        if cur is None:
            cur = dict(setmaxnreg=None, kind="entry", max_reg=-1, hgmma=0, tma=0, ex2=0, n=0)
            regions.append(cur)
        cur["n"] += 1
        regs = [int(r) for r in re.findall(r"\bR(\d+)\b", ins)]
        # vector operands (R24.64 etc.) and HGMMA accumulators cover more than the named register
        if "HGMMA" in ins:
            m = re.search(r"HGMMA\.64x(\d+)x16", ins)
            acc = re.search(r"HGMMA\.\S+\s+R(\d+)", ins)
            if m and acc:
                regs.append(int(acc.group(1)) + int(m.group(1)) // 2 - 1)
            cur["hgmma"] += 1
        for r, w in re.findall(r"\bR(\d+)\.(64|128)\b", ins):
            regs.append(int(r) + int(w) // 32 - 1)
        if regs:
            cur["max_reg"] = max(cur["max_reg"], max(regs))
        cur["tma"] += "UTMALDG" in ins
        cur["ex2"] += "MUFU.EX2" in ins
    return regions


def ex2_under_wgmma(instrs):
    """Per block (label .. next label): (#MUFU.EX2 while >= 1 wgmma group is pending, #EX2, #HGMMA).
    Pending groups: +1 at an HGMMA carrying gsb0 (the last of a committed group), set to
    min(pending, n) at WARPGROUP.DEPBAR.LE gsb0, n. State carries over between consecutive
    blocks in address order (fall-through); a loop header restarts with what the end of the
    body leaves pending, which the second pass over the loop body models."""
    blocks, cur = [], ["entry", 0, 0, 0]
    pending = 0
    for label, ins in instrs:
        if ins is None:
            blocks.append(cur)
            cur = [label, 0, 0, 0]
            continue
        if "HGMMA" in ins:
            cur[3] += 1
            if "gsb0" in ins:
                pending += 1
        elif "WARPGROUP.DEPBAR.LE" in ins:
            pending = min(pending, int(re.search(r"0x([0-9a-f]+)", ins).group(1), 16))
        elif "WARPGROUP.ARRIVE" in ins:
            pass
        elif "MUFU.EX2" in ins:
            cur[2] += 1
            cur[1] += pending > 0
        if "EXIT" in ins or re.match(r"^BRA\b", ins):
            pass
    blocks.append(cur)
    return [tuple(b) for b in blocks if b[2] or b[3]]


def trace(instrs):
    toks = []
    for label, ins in instrs:
        if ins is None:
            t = "\n  " + label
        else:
            m = re.search(r"(HGMMA\.\S+|WARPGROUP\.DEPBAR\.LE gsb0, 0x\d|MUFU\.EX2|BAR\.SYNC(?:\.DEFER_BLOCKING)? 0x\w+(?:, 0x\w+)?|"
                          r"BAR\.ARV \S+|SYNCS\.PHASECHK|SYNCS\.ARRIVE\S*|UTMALDG|UTMASTG|USETMAXREG\S* \S+|EXIT|BRX)", ins)
            if not m:
                continue
            t = m.group(1).replace("WARPGROUP.DEPBAR.LE gsb0, 0x", "DEPBAR").replace(".F32.BF16", "")
            t = t.replace(".F32.F16", "").replace(".DEFER_BLOCKING", "").replace("SYNCS.PHASECHK", "mbar_wait")
            t = t.replace(" ", "_")
            if "HGMMA" in t and "gsb0" in ins:
                t += "+gsb0"
        if toks and toks[-1][1] == t:
            toks[-1][0] += 1
        else:
            toks.append([1, t])
    return " ".join((f"{n}x{t}" if n > 1 else t) for n, t in toks)


DEFAULT_VARIANTS = list(fa_ws.CONFIGS) + ["ws_n128_s2:spec", "ws_n128_s2:g1", "ws_n128_s2:fp16"]


def report(spec, write=True):
    print(f"===== {spec}: (BLOCK_N, NUM_STAGES, PINGPONG, SCHED, CONSUMER_REGS, PRODUCER_REGS) = "
          f"{fa_ws.CONFIGS[parse_variant(spec)[0]]} =====")
    try:
        k = compile_variant(spec)
    except Exception as e:  # noqa: BLE001
        print("COMPILE FAILED:", type(e).__name__, str(e)[:3000])
        return None
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    name = spec.replace(":", "_").replace("=", "")
    regs, st, ld, log, cubin = ptxas(ptx)
    sass = disassemble(cubin) if cubin else ""
    if write:
        os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
        for ext, txt in (("ptx", ptx), ("ttgir", ttgir), ("sass", sass)):
            with open(os.path.join(HERE, "out", f"{name}.{ext}"), "w") as f:
                f.write(txt)
    print("shared mem (bytes):", k.metadata.shared, " num_warps (total):", k.metadata.num_warps)
    print(".maxnreg:", re.findall(r"\.maxnreg (\d+)", ptx), " .reqntid:", re.findall(r"\.reqntid (\d+)", ptx))
    print("setmaxnreg in PTX order:", re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))
    print("wgmma.mma_async:", ptx.count("wgmma.mma_async"), " wait_group values:",
          re.findall(r"wgmma.wait_group.sync.aligned\s+(\d+)", ptx))
    print(f"ptxas -arch=sm_90a: registers={regs} (kernel-wide), spill stores={st} B, spill loads={ld} B")
    for line in log.splitlines():
        if "warning" in line.lower() or "error" in line.lower() or "(C7" in line:
            print("  ptxas:", line.strip()[:300])
    if not sass:
        return None
    instrs = sass_instrs(sass)
    print("SASS regions (from one USETMAXREG to the next, address order):")
    for r in partitions(instrs):
        if r["n"] == 0:
            continue
        role = ("consumer" if r["hgmma"] else "producer" if r["tma"] else "other")
        print(f"   setmaxnreg {r['kind']:<9} {str(r['setmaxnreg']):>4}: {r['n']:4d} instrs, max register R{r['max_reg']}, "
              f"HGMMA {r['hgmma']}, UTMALDG {r['tma']}, MUFU.EX2 {r['ex2']}  [{role}]")
    blocks = ex2_under_wgmma(instrs)
    print("blocks with HGMMA or EX2: (label, #EX2 with a wgmma group pending, #EX2, #HGMMA)")
    for b in blocks:
        print("  ", b)
    regions = [r for r in partitions(instrs) if r["n"]]
    cons = max((r["max_reg"] for r in regions if r["hgmma"]), default=-1)
    prod = max((r["max_reg"] for r in regions if r["tma"]), default=-1)
    under = sum(b[1] for b in blocks)
    total = sum(b[2] for b in blocks)
    c75 = sorted(set(re.findall(r"\((C7\d+)\)", log)))
    print(f"SUMMARY {spec}: ptxas regs {regs}, spills {st}/{ld} B, ptxas notes {c75 or 'none'}, consumer max R{cons}, producer max R{prod}, "
          f"EX2 under a pending wgmma {under}/{total} (all blocks, both consumers)")
    tr = trace(instrs)
    print("SASS trace (DEPBARn = WARPGROUP.DEPBAR.LE gsb0, n; +gsb0 = last HGMMA of a group):")
    print(tr)
    print()
    return dict(regs=regs, spills=(st, ld), blocks=blocks)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    if "--summary" in sys.argv:  # one line per variant
        import contextlib
        import io
        for spec in args or DEFAULT_VARIANTS:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                report(spec)
            lines = [ln for ln in buf.getvalue().splitlines() if ln.startswith(("SUMMARY", "COMPILE FAILED"))]
            print("\n".join(lines) or buf.getvalue()[-2000:])
        return
    for spec in args or DEFAULT_VARIANTS:
        report(spec)


if __name__ == "__main__":
    main()
