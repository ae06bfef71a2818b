"""PROTOTYPE: the batch-1 GEMV with every K tile of a program copied into shared memory (cp.async)
before its PDL wait, so that a wave of programs has up to all its weight bytes in flight while the
previous kernel (a tensor-parallel sum: ~5.6 µs with HBM idle) ends. The Triton GEMV holds two
tiles in registers before the wait (~8 MB from a wave at tp=2's qkv); this holds K / BLOCK_K tiles
in shared memory (64 KB a program at K = 8192: ~25 MB from a wave).

Plain (no bias, no push) or gated (silu(gate) * up), K a multiple of BLOCK_K with at most STEPS_MAX
steps. Gluon: CUDA only.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as ac

from longctx.kernels.utils import cdiv, pdl_launch

_cp_async = getattr(ac, "async_load", None) or ac.async_copy_global_to_shared
STEPS_MAX = 4


@gluon.jit
def _pdl_wait(USE_PDL: gl.constexpr):
    if USE_PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gemv_ring_kernel(X, W, Y, N, K, stride_wn,
                      ROWS: gl.constexpr, BLOCK_K: gl.constexpr, STEPS: gl.constexpr,
                      GATED: gl.constexpr, WARPS: gl.constexpr, USE_PDL: gl.constexpr):
    # ROWS output rows a program; gated: ROWS gate rows and the ROWS up rows N/2 below them.
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [1, WARPS], [1, 0])
    smem_l: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=1, order=[1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    n_out = N // 2 if GATED else N
    offs_o = gl.program_id(0) * ROWS + gl.arange(0, ROWS, layout=row_l)
    rows = gl.minimum(offs_o, n_out - 1).to(gl.int64) * stride_wn
    cols = gl.arange(0, BLOCK_K, layout=col_l)
    ptrs = W + rows[:, None] + cols[None, :]
    w_s = gl.allocate_shared_memory(W.dtype.element_ty, [STEPS, ROWS, BLOCK_K], smem_l)
    if GATED:
        up = W + n_out.to(gl.int64) * stride_wn + rows[:, None] + cols[None, :]
        u_s = gl.allocate_shared_memory(W.dtype.element_ty, [STEPS, ROWS, BLOCK_K], smem_l)
    # Every tile of the program, in flight before the wait (no kernel writes the weights).
    for i in gl.static_range(STEPS):
        _cp_async(w_s.index(i), ptrs + i * BLOCK_K, eviction_policy="evict_first")
        if GATED:
            _cp_async(u_s.index(i), up + i * BLOCK_K, eviction_policy="evict_first")
        ac.commit_group()
    _pdl_wait(USE_PDL)
    acc = gl.zeros([ROWS, BLOCK_K], gl.float32, layout)
    acc_u = gl.zeros([ROWS, BLOCK_K], gl.float32, layout)
    for i in gl.static_range(STEPS):
        ac.wait_group(STEPS - 1 - i)  # each thread reads back only the bytes it copied
        x = gl.load(X + i * BLOCK_K + cols).to(gl.float32)[None, :]
        acc += w_s.index(i).load(layout).to(gl.float32) * x
        if GATED:
            acc_u += u_s.index(i).load(layout).to(gl.float32) * x
    y = gl.sum(acc, axis=1).to(Y.dtype.element_ty)
    if GATED:
        # Rounded as the unfused ops round: projection output, silu(gate), then the product.
        u = gl.sum(acc_u, axis=1).to(Y.dtype.element_ty).to(gl.float32)
        g = y.to(gl.float32)
        a = (g / (1.0 + gl.exp(-g))).to(Y.dtype.element_ty).to(gl.float32)
        y = (a * u).to(Y.dtype.element_ty)
    gl.store(Y + offs_o, y, mask=offs_o < n_out)


def ring_applies(x: torch.Tensor, weight: torch.Tensor, block_k: int) -> bool:
    K = weight.shape[1]
    return x.is_cuda and K % block_k == 0 and K // block_k <= STEPS_MAX


def gemv_ring(x: torch.Tensor, weight: torch.Tensor, block_k: int, warps: int,
              gated: bool = False, rows: int = 4) -> torch.Tensor:
    """As kernels/gemv.py's `gemv` (plain or gated), K = STEPS * block_k with STEPS <= 4."""
    N, K = weight.shape
    x1 = x.reshape(-1)
    n_out = N // 2 if gated else N
    out = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
    # gated: `rows` outputs a program as for plain ones, its gate and up rows in two tiles.
    r = rows // 2 if gated else rows
    launch = pdl_launch(x.device)
    _gemv_ring_kernel[(cdiv(n_out, r),)](
        x1, weight, out, N, K, weight.stride(0), ROWS=r, BLOCK_K=block_k, STEPS=K // block_k,
        GATED=gated, WARPS=warps, num_warps=warps, **launch)
    return out
