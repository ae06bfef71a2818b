"""Offline sm_90 compile check of the Gluon Hopper prefill kernel (kernels/prefill_hopper.py).

    python bench/compile_prefill_hopper.py [--sass DIR] [-j JOBS]

No GPU needed. For every kernel variant the dispatch (`hopper_kernel_applies`) can launch --
bf16 / fp16, causal or not, output or accumulate (the ring's fused merge), one key tile (SINGLE)
or many, GQA group 1 / 3 / 8 / 16 with query-head counts 1, 12, 16, 32, 64 -- it builds the
launch arguments with the launcher's own `launch_args` on CPU tensors and lets Triton's own
binder specialise them for an sm_90 target (integers equal to 1 become constants, multiples of
16 and 16-byte aligned pointers get divisibility hints), so each compiled kernel is the one such
a launch gets. Prints per kernel:

  * registers and spill bytes (ptxas -v with Triton's flags),
  * whether the SASS keeps the softmax under the tensor-core work: in the peeled first key tile
    and in the main loop, the number of HGMMA and of MUFU.EX2 (softmax exp2) between the first
    and the last of those HGMMAs with no WARPGROUP.DEPBAR (wgmma wait) in between. A tile's
    softmax has 64 exp2 per thread; "ok" needs >= 32 of them between >= 4 HGMMAs.

Exit status 1 if a kernel the dispatch can launch spills or loses that interleaving. ptxas decides
the overlap and reacts to small source changes (bench/experiments/gluon_fa_hopper/NOTES.md):
run this after every edit of the kernel. About 2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature

from longctx.kernels import prefill_hopper as H
from longctx.kernels.prefill import hopper_kernel_applies

TARGET = GPUTarget("cuda", 90, 32)  # what an H100 / H200 reports
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
HEADS = [(16, 2), (32, 32), (12, 4), (64, 4), (1, 1)]  # group 8, 1, 3, 16; Hq 1 is a constant
MIN_EX2, MIN_HGMMA = 32, 4


# --------------------------------------------------------------------------- variants
def variants() -> list[dict]:
    """Representative launches: dict(name, dtype, causal, acc, B, Sq, Sk, Hq, Hkv, lse_offset,
    dispatch). lse_offset: lse_acc starts that many floats into its buffer (1: not 16-byte
    aligned, as a slice of a ring's accumulator could be). dispatch=False: reachable only by
    calling hopper_attention_fwd directly (causal one-tile kernels: the dispatch keeps causal
    calls up to 4096 rows on the Triton kernel)."""
    out = []
    for dtype in (torch.bfloat16, torch.float16):
        for hq, hkv in HEADS:
            for causal, sq, sk in ((False, 1024, 1024), (False, 512, 128), (True, 8192, 8192)):
                for acc in (False, True):
                    out.append(dict(dtype=dtype, causal=causal, acc=acc, B=1, Sq=sq, Sk=sk,
                                    Hq=hq, Hkv=hkv, lse_offset=0, dispatch=True))
    out.append(dict(out[0], Sq=384, Sk=2048))                  # Sq != Sk: same kernel
    out.append(dict(out[1], B=2))                              # batch 2: same kernel
    out.append(dict(out[1], lse_offset=1))                     # unaligned lse_acc
    for dtype in (torch.bfloat16, torch.float16):
        for acc in (False, True):
            out.append(dict(dtype=dtype, causal=True, acc=acc, B=1, Sq=128, Sk=128, Hq=16, Hkv=2,
                            lse_offset=0, dispatch=False))
    for v in out:
        v["name"] = (f"{'bf16' if v['dtype'] == torch.bfloat16 else 'fp16'} "
                     f"{'causal' if v['causal'] else 'full'} {'acc' if v['acc'] else 'out'} "
                     f"B={v['B']} {v['Hq']}/{v['Hkv']} Sq={v['Sq']} Sk={v['Sk']}"
                     f"{' lse+1' if v['lse_offset'] else ''}{'' if v['dispatch'] else ' (direct)'}")
    return out


def tensors(v: dict):
    """CPU tensors of the variant's shapes (never touched: only shapes, strides, pointers)."""
    b, sq, sk, hq, hkv = v["B"], v["Sq"], v["Sk"], v["Hq"], v["Hkv"]
    q = torch.empty(b, sq, hq, 128, dtype=v["dtype"])
    k = torch.empty(b, sk, hkv, 128, dtype=v["dtype"])
    acc = None
    if v["acc"]:
        lse_buf = torch.empty(b * sq * hq + v["lse_offset"])
        acc = (torch.empty(b, sq, hq, 128), lse_buf[v["lse_offset"]:].view(b, sq, hq))
    return q, k, torch.empty_like(k), acc


def dispatch_accepts(v: dict) -> bool:
    q, k, val, acc = tensors(v)
    return hopper_kernel_applies(
        dtypes=(q.dtype, k.dtype, val.dtype), shapes=(q.shape, k.shape, val.shape),
        strides=(q.stride(), k.stride(), val.stride()),
        data_ptrs=(q.data_ptr(), k.data_ptr(), val.data_ptr()), capability=(9, 0),
        causal=v["causal"], q_start=0, k_start=0, varlen=False, config_given=False,
        accumulate_strides=None if acc is None else (acc[0].stride(), acc[1].stride()))


# --------------------------------------------------------------------------- compile
def specialise(v: dict):
    """(signature, constexprs, attrs, options) that a launch with the variant's tensors gets."""
    q, k, val, acc = tensors(v)
    _, args, meta, _ = H.launch_args(q, k, val, 128 ** -0.5, v["causal"], acc)
    fn = H._attn_fwd_hopper_kernel
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(meta, debug=knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)  # as JIT run()
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    return signature, constexprs, attrs, options


def ptxas_info(ptx: str) -> tuple[int, int, int, list[str]]:
    """registers, spill store / load bytes and wgmma warnings of ptxas -v with Triton's flags."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([BIN / "ptxas", "-lineinfo", "-v", "--gpu-name=sm_90a", src, "-o",
                            Path(d) / "k.cubin"], capture_output=True, text=True, check=True)
    log = r.stdout + r.stderr
    num = lambda pat: int(re.search(pat, log).group(1))  # noqa: E731
    warnings = [line.strip() for line in log.splitlines() if "warning" in line.lower()]
    return (num(r"Used (\d+) registers"), num(r"(\d+) bytes spill stores"),
            num(r"(\d+) bytes spill loads"), warnings)


def disassemble(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([BIN / "nvdisasm", "-c", path], capture_output=True, text=True,
                              check=True).stdout


def interleaving(instrs: list[str]) -> tuple[int, int]:
    """Best (#HGMMA, #MUFU.EX2 between the first and last of them) over the stretches of
    `instrs` between wgmma waits (WARPGROUP.DEPBAR)."""
    best, window = (0, 0), []
    for ins in instrs + ["WARPGROUP.DEPBAR"]:
        if "WARPGROUP.DEPBAR" not in ins:
            window.append(ins)
            continue
        idx = [i for i, x in enumerate(window) if "HGMMA" in x]
        if idx:
            seg = window[idx[0]:idx[-1] + 1]
            cand = (len(idx), sum("MUFU.EX2" in x for x in seg))
            best = max(best, cand, key=lambda t: (t[1], t[0]))
        window = []
    return best


def overlap(sass: str) -> dict[str, tuple[int, int] | None]:
    """Interleaving in the peeled first tile (code before the main loop) and in the main loop
    (the backward branch before EXIT whose body holds the most HGMMAs; None without one). The
    mbarrier spin loops ptxas moves behind EXIT, and their jumps back, are not loops here."""
    instrs, labels = [], {}
    for line in sass.splitlines():
        if m := re.match(r"^(\.L_x_\d+):", line.strip()):
            labels[m.group(1)] = len(instrs)
        elif m := re.search(r"/\*[0-9a-f]+\*/\s+(.*?)\s*;", line):
            instrs.append(m.group(1))
    end = next(i for i, ins in enumerate(instrs) if ins.split()[-1] == "EXIT")
    loop = None
    for i, ins in enumerate(instrs[:end]):
        if (m := re.search(r"BRA `\((\.L_x_\d+)\)", ins)) and labels[m.group(1)] < i:
            body = (labels[m.group(1)], i)
            n = sum("HGMMA" in x for x in instrs[body[0]:body[1]])
            if n and (loop is None or n > loop[2]):
                loop = (*body, n)
    if loop is None:
        return {"tile 0": None, "loop": None}
    return {"tile 0": interleaving(instrs[:loop[0]]), "loop": interleaving(instrs[loop[0]:loop[1]])}


def compile_variant(v: dict, sass_dir: str | None) -> dict:
    signature, constexprs, attrs, options = specialise(v)
    src = GluonASTSource(H._attn_fwd_hopper_kernel, signature, constexprs, attrs)
    kernel = triton.compile(src, target=TARGET, options=options.__dict__)
    regs, spill_st, spill_ld, warnings = ptxas_info(kernel.asm["ptx"])
    sass = disassemble(kernel.asm["cubin"])
    if sass_dir:
        stem = Path(sass_dir) / re.sub(r"[^\w=+.-]+", "_", v["name"])
        stem.with_suffix(".sass").write_text(sass)
        stem.with_suffix(".ptx").write_text(kernel.asm["ptx"])
    return dict(regs=regs, spills=(spill_st, spill_ld), warnings=warnings, **overlap(sass))


def key(v: dict) -> str:
    signature, constexprs, attrs, _ = specialise(v)
    return repr((signature, sorted(constexprs.items()), sorted(attrs.items())))


# --------------------------------------------------------------------------- report
def verdict(v: dict, r: dict) -> list[str]:
    bad = []
    if r["spills"] != (0, 0):
        bad.append("spills")
    if r["warnings"]:
        bad.append("ptxas warnings")
    for part in ("tile 0", "loop"):
        if r[part] is not None and (r[part][0] < MIN_HGMMA or r[part][1] < MIN_EX2):
            bad.append(f"no overlap in {part}")
    if r["loop"] is None and v["Sk"] != 128:
        bad.append("no main loop found")
    return bad


def fmt(x: tuple[int, int] | None) -> str:
    return "-" if x is None else f"{x[0]} HGMMA / {x[1]} EX2"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sass", metavar="DIR", help="also write each kernel's .sass and .ptx here")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count())
    ap.add_argument("-k", metavar="TEXT", default="", help="only launches whose name contains TEXT")
    args = ap.parse_args()
    if args.sass:
        os.makedirs(args.sass, exist_ok=True)
    vs = [v for v in variants() if args.k in v["name"]]
    for v in vs:
        if dispatch_accepts(v) != v["dispatch"]:
            print(f"{v['name']}: hopper_kernel_applies says {not v['dispatch']}, expected {v['dispatch']}")
            return 1
    first: dict[str, int] = {}
    for i, v in enumerate(vs):
        v["same_as"] = first.setdefault(key(v), i)
    unique = [v for i, v in enumerate(vs) if v["same_as"] == i]
    print(f"triton {triton.__version__}, target sm_90a: {len(vs)} launches, {len(unique)} distinct "
          f"kernels (ptxas: {BIN / 'ptxas'})")
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        results = dict(zip((id(v) for v in unique),
                           pool.map(compile_variant, unique, [args.sass] * len(unique))))
    failed = 0
    print(f"{'#':>2} {'launch':<52} {'regs':>4} {'spill B':>7}  {'tile 0':<20} {'main loop':<20} verdict")
    for i, v in enumerate(vs):
        if v["same_as"] != i:
            print(f"{i:>2} {v['name']:<52} same kernel as #{v['same_as']}")
            continue
        r = results[id(v)]
        bad = verdict(v, r)
        failed += bool(bad) and v["dispatch"]
        print(f"{i:>2} {v['name']:<52} {r['regs']:>4} {'/'.join(map(str, r['spills'])):>7}  "
              f"{fmt(r['tile 0']):<20} {fmt(r['loop']):<20} {', '.join(bad) or 'ok'}")
        for w in r["warnings"]:
            print(f"     ptxas: {w}")
    print(f"{failed} dispatchable kernel(s) spill or lose the softmax/HGMMA interleaving" if failed
          else "every dispatchable kernel: no spills, softmax exp2 interleaved with HGMMA in the "
               "peeled first tile and the main loop (one-tile kernels have neither)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
