"""Matrix-vector product for batch-1 decoding: y [1, N] = x [1, K] @ W[N, K]^T.

At batch 1 a linear layer is a pure stream of its weights, so the ceiling is the HBM read
bandwidth. Each program owns BLOCK_N rows of W and walks K in BLOCK_K steps, multiplying in
fp32 into a [BLOCK_N, BLOCK_K] register tile that is summed once at the end (no per-step
reductions); wide K steps (1-2K elements of 4 rows per load) keep enough bytes in flight per
program to cover HBM latency, and the first step's weights load before the PDL wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longctx.kernels.utils import cdiv, next_power_of_2, pdl_launch, pdl_wait


@triton.jit
def _load_w(W, rows, ks, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(W + rows[:, None] + ks[None, :], eviction_policy="evict_first")
    return tl.load(W + rows[:, None] + ks[None, :], mask=(ks < K)[None, :], other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _load_x(X, ks, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(X + ks).to(tl.float32)
    return tl.load(X + ks, mask=ks < K, other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(X, W, Y, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, GATED: tl.constexpr, USE_PDL: tl.constexpr):
    # GATED: W stacks gate rows [0, N/2) over up rows [N/2, N) and Y gets silu(gate) * up
    # [N/2]. Each program then takes BLOCK_N/2 outputs, interleaving their gate and up rows.
    if GATED:
        n_out = N // 2
        j = tl.arange(0, BLOCK_N)
        offs_o = tl.program_id(0) * (BLOCK_N // 2) + j // 2
        rows = tl.minimum(offs_o, n_out - 1) + (j % 2) * n_out
    else:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows past N read row N-1 (in bounds, discarded at the store): no mask on hot loads.
        rows = tl.minimum(offs_n, N - 1)
    rows = rows.to(tl.int64) * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    # No kernel writes the weights: the first tile's load is issued before the PDL wait, so it
    # overlaps the previous kernel's tail; x comes from that kernel and is read after.
    w = _load_w(W, rows, offs_k, K, EVEN_K)
    pdl_wait(USE_PDL)
    acc = w.to(tl.float32) * _load_x(X, offs_k, K, EVEN_K)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + offs_k
        acc += _load_w(W, rows, ks, K, EVEN_K).to(tl.float32) * _load_x(X, ks, K, EVEN_K)[None, :]
    y = tl.sum(acc, axis=1).to(Y.dtype.element_ty)
    if GATED:
        # Rounded as the unfused ops round: projection output, silu(gate), then the product.
        g, u = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        g = g.to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
        offs_o = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(Y + offs_o, (a * u.to(tl.float32)).to(Y.dtype.element_ty), mask=offs_o < n_out)
    else:
        tl.store(Y + offs_n, y, mask=offs_n < N)


def gemv_config(K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): 4 rows per program, and 2048-wide K steps with 8 warps
    when K is a multiple of 2048 with at least 4 steps, else 1024-wide steps with 4 warps.

    From `bench/gemv.py --tp 1|2 --configs ...` on an H200 (CodeLlama-34B shapes, GEMVs chained
    in a CUDA graph with PDL): 4 x 2048 x 8 reaches 96-101% of the streaming-read
    bandwidth on every 8192-wide weight (q, qkv, o, gate/up, lm_head at tp=1; 90-99% at tp=2)
    and 4 x 1024 x 4 93-97% on the 4096-, 11008- and 22016-wide ones (o and down at tp=2, down
    at tp=1), where 2048-wide steps leave too few steps or a masked tail (91-92%). The previous
    rule (512-wide steps, 4-16 rows for >= 12 programs per SM) reached 82-98%.
    """
    if K < 1024:
        return 4, next_power_of_2(K), 4
    if K % 2048 == 0 and K >= 4 * 2048:
        return 4, 2048, 8
    return 4, 1024, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int] | None = None,
         gated: bool = False) -> torch.Tensor:
    """x [..., K] holding one row, weight [N, K] (unit stride in K) -> [..., N] in x's dtype
    (fp32 accumulation). gated: weight stacks gate over up rows (N even) and the result is
    silu(gate) * up [..., N/2], rounded as longctx.ops.silu_mul after the projection would.
    `config` overrides gemv_config, for tuning sweeps."""
    N, K = weight.shape
    x1 = x.reshape(-1)
    if x1.numel() != K:
        raise ValueError(f"gemv takes one row: x has {x1.numel()} elements, weight is {N}x{K}")
    if gated and N % 2:
        raise ValueError(f"gated gemv needs an even number of weight rows (gate, up), got {N}")
    out = torch.empty(*x.shape[:-1], N // 2 if gated else N, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config or gemv_config(K)
    _gemv_kernel[(cdiv(N, block_n),)](
        x1, weight, out, N, K, weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=K % block_k == 0, GATED=gated, num_warps=warps, **pdl_launch(x.device))
    return out
