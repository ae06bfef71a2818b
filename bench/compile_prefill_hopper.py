"""Offline sm_90 compile check of the Gluon Hopper prefill kernel (kernels/prefill_hopper.py).

    python bench/compile_prefill_hopper.py [--sass DIR] [-j JOBS] [-k TEXT]

No GPU needed. For every kernel variant the dispatch (`hopper_kernel_applies`) can launch --
bf16 / fp16, head_dim 64 / 128 / 256 (and 96, 192, 80, 160, 48 split in two tiles, 40 padded
to 64: kernels/prefill_hopper.py `head_tiles`), causal or not, output or accumulate (the ring's
fused merge), host descriptors (B == 1 at any length, or lengths multiples of the tiles) or
device-side ones (B > 1 with ragged lengths, varlen), causal
offsets as ints or [B] tensors, GQA group 1 / 3 / 8 / 16 with query-head counts 1, 12, 16, 32,
64 -- it builds the launch arguments with the launcher's own `launch_args` on CPU tensors and
lets Triton's own binder specialise them for an sm_90 target (integers equal to 1 become
constants, multiples of 16 and 16-byte aligned pointers get divisibility hints; lengths and
offsets are not specialised), so each compiled kernel is the one such a launch gets. Prints per
kernel:

  * ptxas -v (Triton's flags): registers (for a warp-specialized kernel the kernel-wide
    .maxnreg, 168 at 12 warps; the partitions run under their setmaxnreg limits) and spills;
  * ptxas warnings, C75xx ones in particular (ptxas serializing every wgmma of the kernel);
  * the setmaxnreg values in the PTX, and per partition (consumer warpgroups, producer warp) the
    highest register its SASS touches against its setmaxnreg limit ("R183/240");
  * each consumer's round loop: instructions, PRMTs ("+32p") and local loads / stores ("+6l").

Exit status 1 if a kernel the dispatch can launch spills, touches local memory in a round loop,
gets a ptxas warning (C75xx: wgmma serialization), has no setmaxnreg, or a partition whose
registers exceed its limit. ptxas reacts
to small source changes (bench/experiments/gluon_fa_hopper_ws/NOTES.md at commit 1c9b5b5): run this after every
edit of the kernel. A few minutes on 2 cores.
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
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler.compiler import make_backend

from longctx.kernels import prefill_hopper as H
from longctx.kernels.offline import bind, compile_kernel, disassemble, innermost_loops, target
from longctx.kernels.prefill import hopper_kernel_applies

TARGET = target((9, 0))  # what an H100 / H200 reports
PTXAS = get_ptxas(TARGET.arch).path  # the ptxas Triton itself runs for sm_90 (3.9: a newer one)
HEADS = [(16, 2), (32, 32), (12, 4), (64, 4), (1, 1)]  # group 8, 1, 3, 16; Hq 1 is a constant


# --------------------------------------------------------------------------- variants
def _variant(**kw) -> dict:
    v = dict(dtype=torch.bfloat16, causal=False, acc=False, B=1, Sq=8192, Sk=8192, Hq=16, Hkv=2,
             D=128, varlen=False, offsets="int", lse_offset=0, dispatch=True)
    v.update(kw)
    return v


def variants() -> list[dict]:
    """Representative launches: dict(dtype, causal, acc, B, Sq, Sk, Hq, Hkv, D, varlen, offsets
    ("int" / "tensor"), lse_offset, dispatch). Varlen: B sequences of Sq query / Sk key rows
    each. lse_offset: lse_acc starts that many floats into its buffer (1: not 16-byte aligned,
    as a slice of a ring's accumulator could be). dispatch=False: reachable only by calling
    hopper_attention_fwd directly. Lengths and offsets are not compile-time values (the kernel
    does not specialise them): a ragged length compiles to the same kernel as a multiple of 128
    in the same descriptor mode."""
    out = []
    for dtype in (torch.bfloat16, torch.float16):
        # head_dim 128, host descriptors (B = 1: any length), every GQA shape
        for hq, hkv in HEADS:
            rows = 128 * max(8, -(-512 // hq))  # >= 512 programs of 128 query rows
            for causal, sq, sk in ((False, rows, 1024), (False, rows, 128), (True, 8192, 8192)):
                for acc in (False, True):
                    out.append(_variant(dtype=dtype, causal=causal, acc=acc, Sq=sq, Sk=sk, Hq=hq,
                                        Hkv=hkv))
        # every head_dim: host and device descriptors, varlen, tensor offsets
        for d in (128, 64, 256):
            for causal in (False, True):
                for acc in (False, True):
                    if d != 128:
                        out.append(_variant(dtype=dtype, causal=causal, acc=acc, D=d,
                                            Sq=12000, Sk=12000))
                    out.append(_variant(dtype=dtype, causal=causal, acc=acc, D=d, B=2, Sq=4000,
                                        Sk=4000))
                out.append(_variant(dtype=dtype, causal=causal, D=d, varlen=True, B=3, Sq=3000,
                                    Sk=3000))
            out.append(_variant(dtype=dtype, causal=True, D=d, offsets="tensor", Sq=4000,
                                Sk=5000))
            out.append(_variant(dtype=dtype, causal=True, D=d, offsets="tensor", B=2, Sq=4000,
                                Sk=5000))
            out.append(_variant(dtype=dtype, causal=True, D=d, offsets="tensor", varlen=True,
                                B=3, Sq=3000, Sk=3000))
        # head_dims that are not powers of two, always device descriptors: split into two
        # tiles (96, 192, 80, 160, 48) or padded to the next power of two (40); every variant
        # at 96 and 192, the fp16 ones at 96, a few at the others
        for d in (96, 192, 80, 40, 160, 48):
            if dtype == torch.float16 and d != 96:
                continue
            full_set = d in (96, 192)
            for causal in (False, True):
                for acc in (False, True):
                    if full_set or (causal and acc) or (causal and not acc):
                        out.append(_variant(dtype=dtype, causal=causal, acc=acc, D=d, B=2,
                                            Sq=4000, Sk=4000))
                if full_set or not causal:
                    out.append(_variant(dtype=dtype, causal=causal, D=d, varlen=True, B=3,
                                        Sq=3000, Sk=3000))
            if full_set:
                out.append(_variant(dtype=dtype, causal=True, D=d, offsets="tensor", B=2,
                                    Sq=4000, Sk=5000))
    base = out[0]
    out.append(dict(base, Sk=384))                                   # another Sk: same kernel
    out.append(dict(base, Sq=12000, Sk=12001))                       # ragged lengths, B = 1
    out.append(dict(out[1], B=2))                                    # batch 2: same kernel
    out.append(dict(out[1], lse_offset=1))                           # unaligned lse_acc
    out.append(_variant(causal=True, Sq=3000, Sk=9000))              # chunked prefill's last chunk
    out.append(_variant(causal=True, Sq=12000, Sk=12000, Hq=24, Hkv=8))  # 24/8 heads at 12000
    for dtype in (torch.bfloat16, torch.float16):
        for acc in (False, True):
            out.append(_variant(dtype=dtype, causal=True, acc=acc, Sq=128, Sk=128, dispatch=False))
    out.append(_variant(causal=True, Sq=127, Sk=1, dispatch=False))  # below the dispatch's rows
    for v in out:
        v["name"] = (f"{'bf16' if v['dtype'] == torch.bfloat16 else 'fp16'} D={v['D']} "
                     f"{'causal' if v['causal'] else 'full'} {'acc' if v['acc'] else 'out'} "
                     f"{'varlen' if v['varlen'] else 'B=' + str(v['B'])} {v['Hq']}/{v['Hkv']} "
                     f"Sq={v['Sq']} Sk={v['Sk']}"
                     f"{' q/k_start[B]' if v['offsets'] == 'tensor' else ''}"
                     f"{' lse+1' if v['lse_offset'] else ''}{'' if v['dispatch'] else ' (direct)'}")
    return out


def tensors(v: dict):
    """CPU tensors of the variant's shapes (never touched: only shapes, strides, pointers) and the
    launch's keyword arguments (offsets, cu_seqlens)."""
    b, sq, sk, hq, hkv, d = v["B"], v["Sq"], v["Sk"], v["Hq"], v["Hkv"], v["D"]
    kw = dict(q_start=0, k_start=0)
    if v["varlen"]:
        q = torch.empty(b * sq, hq, d, dtype=v["dtype"])
        k = torch.empty(b * sk, hkv, d, dtype=v["dtype"])
        kw.update(cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32) * sq,
                  cu_seqlens_k=torch.arange(b + 1, dtype=torch.int32) * sk, max_seqlen_q=sq)
    else:
        q = torch.empty(b, sq, hq, d, dtype=v["dtype"])
        k = torch.empty(b, sk, hkv, d, dtype=v["dtype"])
    if v["offsets"] == "tensor":
        kw.update(q_start=torch.full((b,), sk - sq, dtype=torch.int32),
                  k_start=torch.zeros(b, dtype=torch.int64))
    elif v["causal"]:
        kw.update(q_start=sk - sq)
    acc = None
    if v["acc"]:
        lse_buf = torch.empty(b * sq * hq + v["lse_offset"])
        acc = (torch.empty(b, sq, hq, d), lse_buf[v["lse_offset"]:].view(b, sq, hq))
    return q, k, torch.empty_like(k), acc, kw


def dispatch_accepts(v: dict) -> bool:
    q, k, val, _, kw = tensors(v)
    return hopper_kernel_applies(
        dtypes=(q.dtype, k.dtype, val.dtype), shapes=(q.shape, k.shape, val.shape),
        strides=(q.stride(), k.stride(), val.stride()),
        data_ptrs=(q.data_ptr(), k.data_ptr(), val.data_ptr()), capability=(9, 0),
        causal=v["causal"], varlen=v["varlen"], config_given=False,
        num_seqs=v["B"] if v["varlen"] else None)


# --------------------------------------------------------------------------- compile
def launch(v: dict) -> tuple[tuple, dict]:
    """The kernel's arguments and keyword arguments for a launch with the variant's tensors."""
    q, k, val, acc, kw = tensors(v)
    _, args, meta, _ = H.launch_args(q, k, val, v["D"] ** -0.5, v["causal"], acc, **kw)
    return args, meta


def ptxas_info(ptx: str) -> tuple[int, int, int, list[str]]:
    """registers, spill store / load bytes and wgmma warnings of ptxas -v with Triton's flags."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([PTXAS, "-lineinfo", "-v", "--gpu-name=sm_90a", src, "-o",
                            Path(d) / "k.cubin"], capture_output=True, text=True, check=True)
    log = r.stdout + r.stderr
    num = lambda pat: int(re.search(pat, log).group(1))  # noqa: E731
    warnings = [line.strip() for line in log.splitlines() if "warning" in line.lower()]
    return (num(r"Used (\d+) registers"), num(r"(\d+) bytes spill stores"),
            num(r"(\d+) bytes spill loads"), warnings)


def partitions(sass: str) -> list[dict]:
    """The SASS cut at every USETMAXREG (setmaxnreg) into regions, in address order: per region
    the setmaxnreg value and kind, the highest general register it touches (vector operands and
    HGMMA accumulators counted in full) and its #HGMMA / #UTMALDG. A consumer region has HGMMAs,
    the producer's UTMALDGs; the short regions in between are the idle warps' hand-overs."""
    regions, cur = [], None
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if not m:
            continue
        ins = m.group(1)
        if "USETMAXREG" in ins:
            cur = dict(setmaxnreg=int(re.search(r"0x([0-9a-f]+)", ins).group(1), 16),
                       kind=ins.split()[0].split(".")[1].lower(), max_reg=-1, hgmma=0, tma=0, n=0)
            regions.append(cur)
            continue
        if cur is None:
            cur = dict(setmaxnreg=None, kind="entry", max_reg=-1, hgmma=0, tma=0, n=0)
            regions.append(cur)
        cur["n"] += 1
        regs = [int(r) for r in re.findall(r"\bR(\d+)\b", ins)]
        if "HGMMA" in ins:
            cur["hgmma"] += 1
            shape = re.search(r"HGMMA\.64x(\d+)x16", ins)
            acc = re.search(r"HGMMA\.\S+\s+R(\d+)", ins)
            if shape and acc:  # the accumulator: N / 2 registers from the named one
                regs.append(int(acc.group(1)) + int(shape.group(1)) // 2 - 1)
        regs += [int(r) + int(w) // 32 - 1 for r, w in re.findall(r"\bR(\d+)\.(64|128)\b", ins)]
        if regs:
            cur["max_reg"] = max(cur["max_reg"], max(regs))
        cur["tma"] += "UTMALDG" in ins
    return [r for r in regions if r["n"]]


def round_loops(sass: str) -> list[tuple[int, int, int]]:
    """(instructions, PRMTs, local loads and stores) of each innermost SASS loop that issues
    wgmmas and exp2s: the consumers' round loops (per round S = Q K^T, O += P V, the softmax;
    both softmax branches counted). Its length is the hot loop's cost in instructions; PRMTs
    there are register shuffles of P (ptxas adds 32 per round where two loops carry P,
    kernels/prefill_hopper.py); LDL / STL are local memory in the hot loop, which ptxas -v's
    spill bytes do not always show (Triton 3.9, D=96 full acc: 0 bytes, 6 per round)."""
    return [(len(body), sum("PRMT" in x for x in body),
             sum(x.split()[0].split(".")[0] in ("LDL", "STL") for x in body))
            for body in innermost_loops(sass)
            if any("HGMMA" in x for x in body) and any("MUFU.EX2" in x for x in body)]


def compile_variant(v: dict, sass_dir: str | None) -> dict:
    args, meta = launch(v)
    kernel = compile_kernel(H._attn_fwd_hopper_kernel, (9, 0), *args, **meta)
    ptx = kernel.asm["ptx"]
    regs, spill_st, spill_ld, warnings = ptxas_info(ptx)
    sass = disassemble(kernel.asm["cubin"])
    if sass_dir:
        stem = Path(sass_dir) / re.sub(r"[^\w=+.-]+", "_", v["name"])
        stem.with_suffix(".sass").write_text(sass)
        stem.with_suffix(".ptx").write_text(ptx)
    setmaxnreg = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
    parts = partitions(sass)
    consumers = [r for r in parts if r["hgmma"]]
    producers = [r for r in parts if r["tma"] and not r["hgmma"]]
    return dict(regs=regs, spills=(spill_st, spill_ld), warnings=warnings,
                c75=sorted(set(re.findall(r"\((C75\d\d)\)", "\n".join(warnings)))),
                setmaxnreg=setmaxnreg, shared=kernel.metadata.shared,
                consumers=[(r["setmaxnreg"], r["max_reg"]) for r in consumers],
                producers=[(r["setmaxnreg"], r["max_reg"]) for r in producers],
                loops=round_loops(sass))


def key(v: dict) -> str:
    args, meta = launch(v)
    signature, constexprs, attrs, _ = bind(H._attn_fwd_hopper_kernel, make_backend(TARGET), *args,
                                           **meta)
    return repr((signature, sorted(constexprs.items()), sorted(attrs.items())))


# --------------------------------------------------------------------------- report
def verdict(v: dict, r: dict) -> list[str]:
    bad = []
    if r["spills"] != (0, 0):
        bad.append("spills")
    if r["c75"]:
        bad.append("wgmma serialized (" + ", ".join(r["c75"]) + ")")
    elif r["warnings"]:
        bad.append("ptxas warnings")
    if not r["setmaxnreg"]:
        bad.append("no setmaxnreg")
    if len(r["consumers"]) != 2 or len(r["producers"]) != 1:
        bad.append("partitions not found in SASS")
    for limit, used in r["consumers"] + r["producers"]:
        if limit is None or used >= limit:
            bad.append(f"R{used} over setmaxnreg {limit}")
    if any(local for _, _, local in r["loops"]):
        bad.append("local memory in round loops")
    return bad


def fmt_loops(loops: list[tuple[int, int, int]]) -> str:
    """'904 904' (instructions of each consumer's round loop), '+32p' where it has PRMTs,
    '+6l' where it has local loads and stores."""
    return " ".join(f"{n}" + (f"+{p}p" if p else "") + (f"+{lo}l" if lo else "")
                    for n, p, lo in loops) or "-"


def fmt(parts: list[tuple[int, int]]) -> str:
    return " ".join(f"R{used}/{limit}" for limit, used in parts) or "-"


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
            print(f"{v['name']}: hopper_kernel_applies says {not v['dispatch']}, "
                  f"expected {v['dispatch']}")
            return 1
    first: dict[str, int] = {}
    for i, v in enumerate(vs):
        v["same_as"] = first.setdefault(key(v), i)
    unique = [v for i, v in enumerate(vs) if v["same_as"] == i]
    print(f"triton {triton.__version__}, target sm_90a: {len(vs)} launches, {len(unique)} distinct "
          f"kernels (ptxas: {Path(PTXAS).name} {get_ptxas(TARGET.arch).version}, Triton's)")
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        results = dict(zip((id(v) for v in unique),
                           pool.map(compile_variant, unique, [args.sass] * len(unique))))
    failed = 0
    print(f"{'#':>3} {'launch':<68} {'regs':>4} {'spill B':>7} {'smem B':>7}  "
          f"{'consumers (max reg/limit)':<26} {'producer':<9} {'round loops':<12} verdict")
    for i, v in enumerate(vs):
        if v["same_as"] != i:
            print(f"{i:>3} {v['name']:<68} same kernel as #{v['same_as']}")
            continue
        r = results[id(v)]
        bad = verdict(v, r)
        failed += bool(bad) and v["dispatch"]
        print(f"{i:>3} {v['name']:<68} {r['regs']:>4} {'/'.join(map(str, r['spills'])):>7} "
              f"{r['shared']:>7}  {fmt(r['consumers']):<26} {fmt(r['producers']):<9} "
              f"{fmt_loops(r['loops']):<12} {', '.join(bad) or 'ok'}")
        for w in r["warnings"]:
            print(f"     ptxas: {w}")
    smn = sorted({tuple(map(tuple, results[id(v)]["setmaxnreg"])) for v in unique})
    print("setmaxnreg in PTX order (one line per distinct sequence):")
    for seq in smn:
        print("   " + " ".join(f"{k} {n}" for k, n in seq))
    print(f"{failed} dispatchable kernel(s) spill, touch local memory in a round loop, get a "
          f"ptxas warning, or exceed a partition's registers" if failed
          else "every dispatchable kernel: no spills, no local memory in round loops, no ptxas "
               "(C75xx) warnings, setmaxnreg present, every partition within its setmaxnreg limit")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
