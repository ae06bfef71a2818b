"""Matrix-vector product for batch-1 decoding: y [1, N] = x [1, K] @ W[N, K]^T (+ bias [N]).

At batch 1 a linear layer is a pure stream of its weights, so the ceiling is the HBM read
bandwidth. Each program owns BLOCK_N rows of W and walks K in BLOCK_K steps, multiplying in
fp32 into a [BLOCK_N, BLOCK_K] register tile that is summed once at the end (no per-step
reductions); wide K steps (512-2048 elements of 4 rows per load; `gemv_config`) keep enough
bytes in flight per program to cover HBM latency, and the first two steps' weights load before
the PDL wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longctx.kernels.allreduce import PushBuffers, push_constexprs, push_message
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
def _gemv_kernel(X, W, Y, BIAS, N, K, stride_wn, BUF, PEERS, FLAGS, rank, slot,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 GATED: tl.constexpr, HAS_BIAS: tl.constexpr, PUSH: tl.constexpr,
                 WORLD: tl.constexpr, IDT: tl.constexpr, MARK: tl.constexpr,
                 USE_PDL: tl.constexpr, TWO_TILES: tl.constexpr):
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
    # No kernel writes the weights: the first two tiles' loads are issued before the PDL wait,
    # so they overlap the previous kernel's tail (a whole sum of tensor parallelism, with its
    # wait for the peers: 32 MB in flight from a wave of programs at tp=2's shapes); x comes from
    # that kernel and is read after.
    w = _load_w(W, rows, offs_k, K, EVEN_K)
    if TWO_TILES:
        w2 = _load_w(W, rows, BLOCK_K + offs_k, K, EVEN_K)
    pdl_wait(USE_PDL)
    acc = w.to(tl.float32) * _load_x(X, offs_k, K, EVEN_K)[None, :]
    if TWO_TILES:
        acc += w2.to(tl.float32) * _load_x(X, BLOCK_K + offs_k, K, EVEN_K)[None, :]
    for k0 in range((1 + TWO_TILES) * BLOCK_K, K, BLOCK_K):
        ks = k0 + offs_k
        acc += _load_w(W, rows, ks, K, EVEN_K).to(tl.float32) * _load_x(X, ks, K, EVEN_K)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:  # (not GATED) added to the float32 sums: one rounding, as cuBLAS's epilogue
        y += tl.load(BIAS + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    y = y.to(Y.dtype.element_ty)
    if GATED:
        # Rounded as the unfused ops round: projection output, silu(gate), then the product.
        g, u = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        g = g.to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
        offs_o = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(Y + offs_o, (a * u.to(tl.float32)).to(Y.dtype.element_ty), mask=offs_o < n_out)
    else:
        tl.store(Y + offs_n, y, mask=offs_n < N)
        if PUSH:
            # A row-parallel partial: also straight into every rank's all-reduce buffer
            # (kernels/allreduce.py), so the reduction need not wait for this kernel to end.
            rnd = tl.load(FLAGS, volatile=True) % 3
            push_message(BUF, PEERS, rnd, y, offs_n, offs_n < N, rank, slot, WORLD, IDT, MARK)


def gemv_config(N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for weight [N, K]: 4 rows per program; 2048-wide K steps
    with 8 warps when K is a multiple of 2048 with at least 4 steps and N >= 4096 (at least 1024
    programs), or when K is 2048 (one step); 512-wide steps with 2 warps when K is below 8192,
    not a multiple of 1024, and N >= 1.25 K (many short rows); else 1024-wide steps with 4 warps.

    From `bench/gemv.py --tp 1|2 --configs ...` on an H200 (CodeLlama-34B shapes, GEMVs chained
    in a CUDA graph with PDL): 4 x 2048 x 8 reaches 96-101% of the streaming-read
    bandwidth on every 8192-wide weight (q, qkv, o, gate/up, lm_head at tp=1; 90-99% at tp=2)
    and 4 x 1024 x 4 93-97% on the 4096-, 11008- and 22016-wide ones (o and down at tp=2, down
    at tp=1), where 2048-wide steps leave too few steps or a masked tail (91-92%). The previous
    rule (512-wide steps, 4-16 rows for >= 12 programs per SM) reached 82-98%. With fewer rows
    (tp=4's qkv, [2560, 8192]: 640 programs) 1024-wide steps are faster in the model: one tp=4
    rank's work as a one-GPU model read 203.1-203.2 tok/s at 16k against 201.0 with 2048-wide
    steps (+1.1%; 2 x 2048 x 8 and 2 x 1024 x 4 the same as 4 x 1024 x 4), tp=4 itself on 4x
    H200 187.6 against 187.0 (+0.3%) (`bench/results/model/gemv-rules-tp4-shard-h200.txt`). At
    tp=2's qkv ([5120, 8192]) other configs tie with 2048-wide steps
    (`bench/results/model/gemv-rules-tp2-16k-h200.txt`). The short K of tp=4's o ([8192, 2048])
    and down ([8192, 5504]) were chosen in the tp=4 model on 4x H200, two rounds
    (`bench/results/model/gemv-rules-tp4-o-down-h200x4.txt`): 187.7-188.2 tok/s at 16k with the
    1024-wide rule, 189.6-189.8 with down at 4 x 512 x 2, 190.6-190.7 with o at 4 x 2048 x 8 as
    well (+1.5%); down at 4 x 512 x 4, 2 x 512 x 2 or 8 x 512 x 4 and o at 8 x 1024 x 4 lose.
    The longer K keep 1024-wide steps: 512-wide ones lose 2.4% at tp=2 ([8192, 11008]) and
    1.2% on one GPU ([8192, 22016]), and tp=2's o ([8192, 4096]) in two 2048-wide steps ties
    (-0.1%). The 512-wide steps' bound on N / K is from other models' short-K weights, each in
    its tp model on 4x H200 against 1024-wide steps, two rounds
    (`bench/results/model/gemv-rules-other-models-h200x4.txt`): they win where N >= 1.49 K
    (CodeLlama's down at tp=4 above; Qwen2.5-32B's o at tp=2 and 4, +0.5% / +1.3%; a
    Qwen2.5-7B shape's o at tp=2, +2.3%) and lose or tie where N <= 1.14 K (Qwen2.5-32B's down
    at tp=4 [5120, 6912], -0.9%; Llama-3.1-8B's at tp=4 [4096, 3584], -1.3%; a Qwen2.5-72B
    shape's at tp=4 [8192, 7392], 0.0%). Where N / K lies between (1.14-1.49) nothing was
    measured.
    """
    if K < 1024:
        return 4, next_power_of_2(K), 4
    if K == 2048 or (K % 2048 == 0 and K >= 4 * 2048 and N >= 4096):
        return 4, 2048, 8
    if K < 8192 and K % 1024 and 4 * N >= 5 * K:
        return 4, 512, 2
    return 4, 1024, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int] | None = None,
         gated: bool = False, bias: torch.Tensor | None = None,
         push: PushBuffers | None = None) -> torch.Tensor:
    """x [..., K] holding one row, weight [N, K] (unit stride in K) -> [..., N] in x's dtype
    (fp32 accumulation; bias [N], contiguous, added before the rounding). gated: weight stacks
    gate over up rows (N even) and the result is silu(gate) * up [..., N/2], rounded as
    longctx.ops.silu_mul after the projection would (no bias). push: this rank's buffers of a
    push all-reduce (kernels/allreduce.py): the result, a row-parallel partial, is also pushed
    into every rank's buffer; the all-reduce call that follows must pass pushed=True. `config`
    overrides gemv_config, for tuning sweeps."""
    N, K = weight.shape
    x1 = x.reshape(-1)
    if x1.numel() != K:
        raise ValueError(f"gemv takes one row: x has {x1.numel()} elements, weight is {N}x{K}")
    if gated and N % 2:
        raise ValueError(f"gated gemv needs an even number of weight rows (gate, up), got {N}")
    if bias is not None and (gated or bias.shape != (N,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be contiguous [{N}] and comes without gated, got "
                         f"{tuple(bias.shape)} (gated={gated})")
    if push is not None and (gated or bias is not None or N > push.slot):
        # A pushed output is a row-parallel partial: a bias would be added once per rank.
        raise ValueError(f"gemv with push takes a plain projection (no gated, no bias) of at "
                         f"most {push.slot} outputs, got {N} (gated={gated}, "
                         f"bias={'given' if bias is not None else None})")
    out = torch.empty(*x.shape[:-1], N // 2 if gated else N, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config or gemv_config(N, K)
    buf, peers, flags, rank, slot = push if push is not None else (x1, x1, x1, 0, 0)
    _gemv_kernel[(cdiv(N, block_n),)](
        x1, weight, out, x1 if bias is None else bias, N, K, weight.stride(0), buf, peers, flags,
        rank, slot, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0, GATED=gated,
        HAS_BIAS=bias is not None, PUSH=push is not None,
        **push_constexprs(x.dtype, peers.numel() if push else 0),
        num_warps=warps, TWO_TILES=K > block_k, **pdl_launch(x.device))
    return out


@triton.jit
def _skinny_kernel(X, W, Y, BIAS, M, N, K, stride_xm, stride_wn, stride_ym,
                   BUF, PEERS, FLAGS, rank, slot,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, PUSH: tl.constexpr,
                   WORLD: tl.constexpr, IDT: tl.constexpr, MARK: tl.constexpr,
                   USE_PDL: tl.constexpr):
    # Y^T [N, M] = W [N, K] @ X^T [K, M] for a few rows M <= BLOCK_M: the weight tile is the
    # MMA's long side and the rows its short one, so each weight byte is read once, by one
    # program, and no split-K partials need a second pass. Rows past N read row N-1 (kept in
    # bounds, discarded at the store), as in the GEMV.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    pdl_wait(USE_PDL)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        if EVEN_K:
            w = tl.load(W + rows[:, None] + ks[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(W + rows[:, None] + ks[None, :], mask=(ks < K)[None, :], other=0.0,
                        eviction_policy="evict_first")
        xt = tl.load(X + offs_m[None, :] * stride_xm + ks[:, None],
                     mask=(offs_m < M)[None, :] & (ks < K)[:, None], other=0.0)
        acc = tl.dot(w, xt, acc)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    y = acc.to(Y.dtype.element_ty)
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], y, mask=mask)
    if PUSH:
        # As the GEMV's: the partial [M, N] also goes straight into every rank's buffer.
        rnd = tl.load(FLAGS, volatile=True) % 3
        push_message(BUF, PEERS, rnd, y, offs_m[None, :] * N + offs_n[:, None], mask, rank, slot,
                     WORLD, IDT, MARK)


SKINNY_MAX_ROWS = 16


def skinny_config(N: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of `skinny_gemm`: 64-row weight tiles 256 wide,
    4 loads in flight; 128 wide where the outputs are very many (N > 32768: tp=1's gate_up);
    32 rows where they are few (N < 4096: tp=4's qkv, 80 programs instead of 40).

    In the model (CodeLlama-34B, tp=2, batch 8 x 32k, 2x H200,
    `bench/results/model/skinny-rule-tp2-b8-h200.txt`) 256-wide steps read 531-533 tokens/s
    (89.6% of the limit) against 524 for the rule before them (64 x 128, 4 or 6 stages); 5
    stages tie, 3 stages (523), 8 warps (507) and 512-wide steps (493) are slower. One GPU at
    batch 8 x 32k reads the same with either rule (286.1 against 286.5). Chained alone
    (`bench/gemv.py --rows 8`, H200, `bench/results/gemv-skinny-256-h200.txt`) 256-wide steps
    gain at tp=2's gate_up (91% -> 94% of the read bandwidth), tie elsewhere and lose at tp=1's
    gate_up (97% -> 96%). Such a chain of one GEMM with PDL reads tp=2's qkv slower with them
    (66% against 76%; 84% without PDL), which the model does not show (a guess: the next GEMM's
    waiting programs, 160 KB of shared memory each, crowd the running ones; in a model other
    kernels come between). One tp=4 rank's work as a one-GPU model at batch 8 x 32k
    (`bench/results/model/gemv-rules-tp4-shard-h200.txt`): qkv ([2560, 8192]) at 32 x 256 reads
    986.4-987.2 tokens/s against 984.2-984.3 (+0.25%); every weight at 32 x 256, 978.0-978.1.
    At tp=4 itself (4x H200, one round) 924.8 against 923.6 (+0.1%).
    Only 8 rows were timed with this rule; it serves 2-16.
    """
    if N > 32768:
        return 64, 128, 4, 4
    return (32 if N < 4096 else 64), 256, 4, 4


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: tuple[int, int, int, int] | None = None,
                push: PushBuffers | None = None) -> torch.Tensor:
    """x [..., K] holding M <= 16 rows (unit stride in K), weight [N, K] (unit stride in K),
    bias [N] or None -> [..., N] in x's dtype (float32 accumulation on the tensor cores, the
    bias added before the one rounding). The projections of a decode step at batch 2-16.
    push: as `gemv`'s (the [M, N] result also goes into every rank's buffers; M * N <=
    push.slot). `config` overrides skinny_config, for tuning sweeps."""
    N, K = weight.shape
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if not 1 <= M <= SKINNY_MAX_ROWS or x.shape[-1] != K or x2.stride(-1) != 1:
        raise ValueError(f"skinny_gemm takes 1-{SKINNY_MAX_ROWS} rows of {K} with unit stride, "
                         f"got x {tuple(x.shape)}")
    if bias is not None and (bias.shape != (N,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be contiguous [{N}], got {tuple(bias.shape)}")
    if push is not None and bias is not None:
        # A pushed output is a row-parallel partial: a bias would be added once per rank.
        raise ValueError("skinny_gemm with push takes no bias (each rank would add it)")
    if push is not None and M * N > push.slot:
        raise ValueError(f"skinny_gemm pushes at most {push.slot} elements, got {M} x {N}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config or skinny_config(N, K)
    buf, peers, flags, rank, slot = push if push is not None else (x2, x2, x2, 0, 0)
    _skinny_kernel[(cdiv(N, block_n),)](
        x2, weight, out, x2 if bias is None else bias, M, N, K, x2.stride(0), weight.stride(0),
        out.stride(0), buf, peers, flags, rank, slot, BLOCK_M=16, BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_K=K % block_k == 0, HAS_BIAS=bias is not None,
        PUSH=push is not None, **push_constexprs(x.dtype, peers.numel() if push else 0),
        num_warps=warps, num_stages=stages, **pdl_launch(x.device))
    return out.view(*x.shape[:-1], N)
