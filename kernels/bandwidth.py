"""HBM read bandwidth of the current GPU, measured with a streaming read kernel: the physical
floor that decode (a memory-bound workload) is reported against."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longctx.kernels.utils import FP_FUSION, cdiv


@triton.jit
def _read_kernel(X, OUT, N, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # Each program streams ITERS blocks and writes one number: pure HBM reads.
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < N, other=0.0).to(tl.float32)
    tl.store(OUT + tl.program_id(0), tl.sum(acc, axis=0))


def read_bandwidth(nbytes: int = 4 << 30) -> float:
    """HBM read bandwidth (bytes/s) of the current CUDA device over `nbytes` (>> L2), the median
    of triton.testing.do_bench (which flushes L2 between repetitions)."""
    x = torch.randn(nbytes // 2, device="cuda", dtype=torch.float16)
    BLOCK, ITERS = 4096, 16
    grid = cdiv(x.numel(), BLOCK * ITERS)
    out = torch.empty(grid, device="cuda", dtype=torch.float32)
    ms = triton.testing.do_bench(lambda: _read_kernel[(grid,)](x, out, x.numel(), BLOCK=BLOCK,
                                                               ITERS=ITERS, num_warps=8,
                                                               **FP_FUSION),
                                 warmup=50, rep=300, return_mode="median")
    del x, out
    torch.cuda.empty_cache()
    return nbytes / (ms * 1e-3)
