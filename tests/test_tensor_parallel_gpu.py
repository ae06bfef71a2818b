"""Tensor parallelism's fused all-reduce + residual add + RMSNorm on two GPUs: as accurate as
NCCL's all-reduce followed by the norm (against float64), bit-identical on both ranks, and the
same when replayed from a CUDA graph (chained calls, so a buffer or flag reused too early, or a
replay that breaks the alternation of buffer halves, would show)."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

N = 8192


def _chain(norm, x0, parts):
    # Each call's inputs depend on the previous result, as in a decode step: the residual
    # stream goes on, the next partial sum is computed from the last norm's output.
    x, outs = x0, []
    for p in parts:
        x, y = norm(x, p * 0.5 + 0.25 * outs[-1][1] if outs else p.clone())
        outs.append((x, y))
    return outs


def _same_on_all_ranks(t, world):
    both = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(both, t)
    return all(torch.equal(both[0], b) for b in both[1:])


def _worker(rank, world):
    from longctx.ops import rms_norm
    from longctx.parallel.tensor_parallel import AllReduceRMSNorm, SymmetricAllReduceNorm

    device = torch.device("cuda", rank)
    group = dist.group.WORLD
    for dtype in (torch.float32, torch.bfloat16):
        fused = SymmetricAllReduceNorm(group, device, dtype)
        base = torch.nn.Module()
        base.weight = torch.nn.Parameter(torch.rand(N, device=device).to(dtype) + 0.5)
        base.eps = 1e-5
        sym = AllReduceRMSNorm(base, group, fused)
        ref = AllReduceRMSNorm(base, group, None)  # NCCL, then the norm kernel
        g = torch.Generator(device=device).manual_seed(10 + rank)
        gx = torch.Generator(device=device).manual_seed(99)  # the residual: same on every rank

        # One call against float64: error at most twice that of NCCL + norm in the same dtype.
        x = (torch.randn(1, 1, N, device=device, generator=gx) * 2).to(dtype)
        part = torch.randn(1, 1, N, device=device, generator=g).to(dtype)
        parts = [torch.empty_like(part) for _ in range(world)]
        dist.all_gather(parts, part)
        s64 = x.double() + sum(p.double() for p in parts)
        y64 = base.weight.double() * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5)
        (s, y), (s_ref, y_ref) = sym(x, part), ref(x, part.clone())
        for got, plain, exact in ((s, s_ref, s64), (y, y_ref, y64)):
            err, err_plain = (got.double() - exact).abs().max(), (plain.double() - exact).abs().max()
            floor = 2 * torch.finfo(dtype).eps * exact.abs().max()  # a couple of ulps
            assert err <= 2 * err_plain + floor, (dtype, err, err_plain)
            assert _same_on_all_ranks(got, world)

        x0 = torch.randn(1, 1, N, device=device, generator=gx).to(dtype)
        chain = [torch.randn(1, 1, N, device=device, generator=g).to(dtype) for _ in range(7)]
        eager = _chain(sym, x0, chain)
        if dtype == torch.float32:  # two ranks: the same additions as NCCL's, in fp32
            for (s, y), (s_ref, y_ref) in zip(eager, _chain(ref, x0, chain)):
                torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        # Captured once, replayed: 7 calls per replay (odd), so the buffer halves alternate
        # across replays only through the device-side counter.
        static = [p.clone() for p in chain]
        static_x = x0.clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            _chain(sym, static_x, static)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = _chain(sym, static_x, static)
        for _ in range(3):
            fresh = [torch.randn(1, 1, N, device=device, generator=g).to(dtype) for _ in chain]
            for dst, src in zip(static, fresh):
                dst.copy_(src)
            graph.replay()
            for (s, y), (s_want, y_want) in zip(outs, _chain(sym, x0, fresh)):
                assert torch.equal(s, s_want) and torch.equal(y, y_want)
                assert _same_on_all_ranks(s, world) and _same_on_all_ranks(y, world)
        # Larger than a rank's slot (prefill): NCCL, then the norm.
        rows = fused.slot // N + 1
        xb = torch.randn(rows, N, device=device, generator=gx).to(dtype)
        pb = torch.randn(rows, N, device=device, generator=g).to(dtype)
        total = pb.clone()
        dist.all_reduce(total)
        want = rms_norm(xb, base.weight, base.eps, total)
        got = sym(xb, pb)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fused_all_reduce_norm_matches_nccl():
    run_distributed(_worker, 2, backend="nccl")
