"""Offline probe (compiles, never runs): the fp8 decode loop written in Gluon, where the kernel
places its own layouts, against the Triton kernel's (bench/compile_decode.py --fp8 --key-major).

    python bench/gluon_fp8_loop_probe.py

No GPU needed; compiles for sm_90 and prints, per probe, the instructions of the loop that
issues the MMAs (one 128-key block per iteration, per warp) and its most frequent opcodes. The
question it answers: in Triton's loop q is re-read from shared memory every block (Triton's
ReorderInstructions sinks q's single-use operand load into the loop; BENCHMARKS.md, fp8
section). Loaded once in Gluon straight into the MMA operand layout, does it stay in registers?

- `qk`: q . K^T alone, q a float16 mma_v2 A operand (k_width as given), K's e4m3 tile copied
  to shared memory (cp.async), loaded as the B operand and widened by Triton's conversion.
- `loop`: a whole online-softmax block of an fp8 cache with V stored key-major ([D, S]): q . K^T
  with K's scales, the running max and sum, P @ V with V's scales, P passed across the warps
  by convert_layout.

These are probes, not longctx kernels: one program, one KV head, no split range, no mask for a
last partial block, no running V-scale bound (`_attend_block`'s u_v), no software pipelining (the
copy of each block waited for at once). Their outputs were never checked. Instruction counts
only, as a guide to what a Gluon decode kernel would save.
"""

from __future__ import annotations

import collections
import re

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as ac
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from longctx.kernels.offline import compile_kernel, disassemble, innermost_loops
from longctx.kernels.utils import FP_FUSION

# Triton 3.9 renamed cp.async's global-to-shared copy (kernels/prefill_hopper.py does the same
# for TMA's).
_cp_async = getattr(ac, "async_load", None) or ac.async_copy_global_to_shared

# Both probes: mma_v2 with the 4 warps side by side along N, cp.async copies of 16 bytes a thread
# along a tile's 128-byte rows, and those rows in shared memory swizzled for ldmatrix.
_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4],
                                              instr_shape=[16, 8]))
_CP = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))
_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0]))


@gluon.jit
def _load_q(Q, H: gl.constexpr, D: gl.constexpr, a_l: gl.constexpr):
    """q [H, D] loaded once, straight into the A operand's layout (kept in registers)."""
    hq = gl.arange(0, H, layout=gl.SliceLayout(1, a_l))
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, a_l))
    return gl.load(Q + hq[:, None] * D + dq[None, :])


@gluon.jit
def qk_probe(Q, K, O, n_blocks, KW: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
             H: gl.constexpr):
    mma: gl.constexpr = _MMA
    ld: gl.constexpr = _CP
    sl: gl.constexpr = _SMEM
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    q = _load_q(Q, H, D, a_l)
    k_s = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_N, D], sl)
    acc = gl.zeros([H, BLOCK_N], gl.float32, mma)
    rows0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    for i in range(n_blocks):
        buf = k_s.index(i % 2)
        _cp_async(buf, K + (rows0 + i * BLOCK_N)[:, None] * D + cols[None, :])
        ac.commit_group()
        ac.wait_group(0)
        kt = buf.permute((1, 0)).load(b_l)
        acc = mma_v2(q, kt.to(gl.float16), acc)
    ho = gl.arange(0, H, layout=gl.SliceLayout(1, mma))
    no = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    gl.store(O + ho[:, None] * BLOCK_N + no[None, :], acc)


@gluon.jit
def loop_probe(Q, K, V, KS, VS, O, n_blocks, qk_scale, S_PAD, KW: gl.constexpr,
               BLOCK_N: gl.constexpr, D: gl.constexpr, H: gl.constexpr):
    mma: gl.constexpr = _MMA
    ld: gl.constexpr = _CP
    sl: gl.constexpr = _SMEM
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    row: gl.constexpr = gl.SliceLayout(1, mma)
    col: gl.constexpr = gl.SliceLayout(0, mma)
    q = _load_q(Q, H, D, a_l)
    k_s = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_N, D], sl)
    v_s = gl.allocate_shared_memory(gl.float8e4nv, [2, D, BLOCK_N], sl)  # V key-major
    m_i = gl.full([H], float("-inf"), gl.float32, row)
    l_i = gl.zeros([H], gl.float32, row)
    acc = gl.zeros([H, D], gl.float32, mma)
    rows0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    vrows = gl.arange(0, D, layout=gl.SliceLayout(1, ld))
    vcols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, ld))
    ncol = gl.arange(0, BLOCK_N, layout=col)
    for i in range(n_blocks):
        kb = k_s.index(i % 2)
        vb = v_s.index(i % 2)
        _cp_async(kb, K + (rows0 + i * BLOCK_N)[:, None] * D + cols[None, :])
        _cp_async(
            vb, V + vrows[:, None] * S_PAD + (vcols0 + i * BLOCK_N)[None, :])
        ac.commit_group()
        ac.wait_group(0)
        kt = kb.permute((1, 0)).load(b_l)
        s = mma_v2(q, kt.to(gl.float16), gl.zeros([H, BLOCK_N], gl.float32, mma))
        k_sc = gl.load(KS + i * BLOCK_N + ncol)
        v_sc = gl.load(VS + i * BLOCK_N + ncol)
        s = s * gl.expand_dims(k_sc * qk_scale, 0)
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        p = p * gl.expand_dims(v_sc, 0)
        pa = gl.convert_layout(p.to(gl.float16), a_l)
        vt = vb.permute((1, 0)).load(b_l)
        acc = mma_v2(pa, vt.to(gl.float16), acc * gl.expand_dims(alpha, 1))
        m_i = m_new
    acc = acc / gl.expand_dims(l_i, 1)
    ho = gl.arange(0, H, layout=row)
    do = gl.arange(0, D, layout=col)
    gl.store(O + ho[:, None] * D + do[None, :], acc)


def _report(name: str, ck) -> None:
    loops = [b for b in innermost_loops(disassemble(ck.asm["cubin"]))
             if any("MMA" in x for x in b)]
    body = max(loops, key=len)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0] for x in body)
    print(f"{name}: loop {len(body)} instructions, shared memory {ck.metadata.shared} B")
    print("    " + ", ".join(f"{k} {n}" for k, n in ops.most_common(14)))


def main() -> None:
    H, D, N, blocks = 16, 128, 128, 8  # 16/2 heads' tile: 16 query rows, head_dim 128
    q = torch.empty(H, D, dtype=torch.float16)
    k = torch.empty(N * blocks, D, dtype=torch.float8_e4m3fn)
    v = torch.empty(D, N * blocks, dtype=torch.float8_e4m3fn)
    scales = torch.empty(N * blocks)
    for kw in (4, 2):
        _report(f"qk, k_width {kw}",
                compile_kernel(qk_probe, (9, 0), q, k, torch.empty(H, N), blocks, KW=kw,
                               BLOCK_N=N, D=D, H=H, num_warps=4, **FP_FUSION))
    _report("loop, k_width 4",
            compile_kernel(loop_probe, (9, 0), q, k, v, scales, scales, torch.empty(H, D),
                           blocks, 0.1, N * blocks, KW=4, BLOCK_N=N, D=D, H=H, num_warps=4, **FP_FUSION))


if __name__ == "__main__":
    main()
