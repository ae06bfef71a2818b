"""Offline sm_90 compile of the split-KV decode kernel (kernels/decode.py): the hot loop's SASS.

    python bench/compile_decode.py                      # bf16 vs fp8 cache, 16/2 heads, D=128
    python bench/compile_decode.py --fp8 --config 128,4,2 --sass loop.sass
    python bench/compile_decode.py --fp8 --widen triton # fp8 tiles widened by Triton's .to()
    python bench/compile_decode.py --fp8 --key-major    # V stored key-major (longctx.fp8)
    python bench/compile_decode.py --fp8 --key-major --page-size 16  # paged, that layout per page

No GPU needed. Builds the launch `kernels/decode.py` makes for a contiguous cache (1 x 262144 keys,
16 / 2 heads unless told; the split count and config as given or by the launch rule) on CPU
tensors, lets Triton's binder specialise the arguments for an sm_90 target as a launch would, and
compiles. Prints per kernel: shared memory, the instructions of the innermost loop that issues
tensor-core MMAs (one key block per iteration: the kernel's cost per BLOCK_N keys per thread) and
its most frequent opcodes. On a CPU the launch would take Triton's conversion for an fp8 cache
(no CUDA capability to check); `--widen` says which one to compile, `cvt` (default: what an sm_89+
GPU runs) or `triton`; `--key-major` stores the fp8 V key-major (`longctx.fp8.key_major_v`, the
model's layout), with that layout's split count and launch rule; `--page-size N` makes the cache
paged (pages of N keys in order; with `--key-major` K and the scales head-major and V key-major
within each page, `longctx.fp8.model_layout(paged=True)`).

BENCHMARKS.md quotes these counts: the fp8 section those of b107688's kernel (the bf16 cache's 703
instructions per 128 keys, the fp8 cache's 777 / 810 at 2 / 3 stages, 1267 with `--widen triton
--q fp16 --config 128,4,3`), the decode section those after its loads lost their row masks (584
for the bf16 cache, 749 / 759 for the fp8 one).
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

import torch

from longctx.fp8 import head_major, key_major_v
from longctx.kernels import decode as D
from longctx.kernels.offline import compile_kernel, disassemble, innermost_loops
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def compile_decode(fp8: bool, q_dtype: torch.dtype, config: tuple[int, int, int] | None,
                   widen_cvt: bool = True, B: int = 1, S: int = 262144, Hq: int = 16,
                   Hkv: int = 2, Dh: int = 128, splits: int | None = None,
                   key_major: bool = False, page_size: int | None = None):
    """The compiled split kernel (Triton's CompiledKernel) of that launch, for sm_90; key_major:
    the fp8 V stored key-major (K and the scales head-major too when paged); page_size: a paged
    cache."""
    if key_major and not fp8:
        raise ValueError("key_major needs fp8: only an fp8 V is stored key-major")
    q = torch.empty(B, Hq, Dh, dtype=q_dtype)
    dims = (B, S) if page_size is None else (B * S // page_size, page_size)
    paged = page_size is not None
    k = torch.empty(*dims, Hkv, Dh, dtype=torch.float8_e4m3fn if fp8 else q_dtype)
    ks = vs = torch.empty(*dims, Hkv) if fp8 else None
    if key_major and paged:
        k, ks, vs = (head_major(t.shape, t.dtype, "cpu", paged=True) for t in (k, ks, vs))
    v = key_major_v(k.shape, "cpu", paged) if key_major else torch.empty_like(k)
    lens = torch.empty(B, dtype=torch.int32)
    table = torch.empty(B, S // page_size, dtype=torch.int32) if paged else None
    if splits is None:
        # (a CPU tensor's device: the rule of a GPU not named H100)
        splits = D.choose_num_splits(B, Hkv, S, 132,
                                     **D.splits_rule(Dh, fp8, q.device,
                                                     D.key_major_rule(fp8, v, page_size)))
    launch = D._split_launch(q, k, v, lens, table, Dh ** -0.5, splits, torch.float32, config,
                             k_scale=ks, v_scale=vs)
    kwargs = dict(launch.kwargs, USE_PDL=True)  # as on an sm_90 GPU
    kwargs.pop("launch_pdl", None)
    if fp8:
        kwargs["FP8_WIDEN"] = widen_cvt and q_dtype != torch.float32
    o = torch.empty(splits, B, Hq, Dh)
    lse = torch.empty(splits, B, Hq)
    dyn = (q, k, v, lens, lens if table is None else table, o, lse, o, lse, lse,
           ks if fp8 else lse, vs if fp8 else lse)
    return compile_kernel(launch.fn, (9, 0), *dyn, *launch.tail, **kwargs)


def hot_loop(cubin: bytes) -> list[str]:
    """The instructions of the longest innermost SASS loop that issues MMAs."""
    loops = [b for b in innermost_loops(disassemble(cubin)) if any("MMA" in x for x in b)]
    return max(loops, key=len, default=[])


def opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fp8", action="store_true", help="only the fp8 cache (default: both)")
    ap.add_argument("--q", choices=DTYPES, default="bf16",
                    help="q's dtype (the cache's if not fp8)")
    ap.add_argument("--config", help="BLOCK_N,num_warps,num_stages (default: the launch rule)")
    ap.add_argument("--widen", choices=("cvt", "triton"), default="cvt")
    ap.add_argument("--key-major", action="store_true",
                    help="store the fp8 V key-major (longctx.fp8.key_major_v)")
    ap.add_argument("--page-size", type=int, help="a paged cache, pages of this many keys")
    ap.add_argument("--sass", help="write the fp8 kernel's hot loop here")
    args = ap.parse_args()
    config = tuple(int(x) for x in args.config.split(",")) if args.config else None
    for fp8 in ((True,) if args.fp8 else (False, True)):
        ck = compile_decode(fp8, DTYPES[args.q], config, args.widen == "cvt",
                            key_major=fp8 and args.key_major, page_size=args.page_size)
        body = hot_loop(ck.asm["cubin"])
        top = collections.Counter(opcode(x) for x in body).most_common(14)
        name = ("fp8 cache" + (", V key-major" if args.key_major else "")) if fp8 else \
            f"{args.q} cache"
        name += f", pages of {args.page_size}" if args.page_size else ""
        print(f"{name}, {args.q} q, {ck.metadata.num_warps} warps: "
              f"shared memory {ck.metadata.shared} B, loop {len(body)} instructions")
        print("    " + ", ".join(f"{k} {n}" for k, n in top))
        if fp8 and args.sass:
            Path(args.sass).write_text("\n".join(body) + "\n")


if __name__ == "__main__":
    main()
