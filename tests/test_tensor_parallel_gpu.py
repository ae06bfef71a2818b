"""Tensor parallelism's symmetric-memory all-reduce on two and four GPUs: the same sums as NCCL,
eagerly and replayed from a CUDA graph (chained calls, so a buffer reused too early would show),
and the same bits on every rank (ranks that disagreed would drift apart layer by layer)."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.gpu


def _chain(reduce, xs):
    """Consecutive all-reduces back to back, as o_proj and down_proj of successive layers: each
    call's input depends on the previous result. Returns (inputs, outputs) of every call."""
    y, ins, outs = xs[0], [], []
    for x in xs[1:]:
        ins.append(y)
        y = reduce(y)
        outs.append(y)
        y = y * 0.5 + x
    return ins, outs


def _check(ins, outs, world, nccl_outs=None):
    """Every output is the sum of its input over the ranks, within the rounding of a W-term sum
    (against the float64 sum; the order of additions is the implementation's), and the same bits
    on every rank (ranks that disagreed would drift apart layer by layer). With two ranks (one
    addition, no order) it must also equal NCCL's bits."""
    u = 2.0 ** (-8 if ins[0].dtype == torch.bfloat16 else -24)  # unit roundoff
    for i, (x, got) in enumerate(zip(ins, outs)):
        parts = [torch.empty_like(x, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(parts, x.double())
        exact = torch.stack(parts).sum(0)
        bound = world * u * torch.stack(parts).abs().sum(0) + u * exact.abs()
        err = (got.double() - exact).abs()
        assert bool((err <= bound).all()), f"call {i}: error {err.max().item():.3e} beyond the rounding bound"
        mine = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(mine, got)
        assert all(torch.equal(m, got) for m in mine), f"call {i}: ranks disagree"
        if world == 2 and nccl_outs is not None:
            torch.testing.assert_close(got, nccl_outs[i], rtol=0, atol=0)


def _worker(rank, world):
    from longctx.parallel.tensor_parallel import SymmetricMemoryAllReduce

    device = torch.device("cuda", rank)
    group = dist.group.WORLD
    for dtype in (torch.bfloat16, torch.float32):
        sym = SymmetricMemoryAllReduce(group, device, dtype)
        g = torch.Generator(device=device).manual_seed(10 + rank)
        xs = [torch.randn(1, 1, 8192, device=device, generator=g).to(dtype) for _ in range(7)]

        def nccl(t):
            t = t.clone()
            dist.all_reduce(t)
            return t

        nccl_ins, nccl_outs = _chain(nccl, xs)
        _check(nccl_ins, nccl_outs, world)  # the bound holds for NCCL too
        _check(*_chain(sym, xs), world, nccl_outs)
        # The same chain captured once and replayed, with new inputs copied in between.
        static = [x.clone() for x in xs]
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            _chain(sym, static)
        torch.cuda.current_stream(device).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ins, outs = _chain(sym, static)
        for _ in range(3):
            fresh = [torch.randn(1, 1, 8192, device=device, generator=g).to(dtype) for _ in xs]
            for dst, src in zip(static, fresh):
                dst.copy_(src)
            graph.replay()
            _check(ins, outs, world, _chain(nccl, fresh)[1])
        # Larger than the buffer: NCCL in place.
        big = torch.ones(SymmetricMemoryAllReduce.MAX_BYTES // dtype.itemsize + 1, device=device,
                         dtype=dtype)
        assert torch.equal(sym(big), torch.full_like(big, float(world)))


@pytest.mark.parametrize("world", [2, 4])
def test_symmetric_memory_all_reduce_matches_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    run_distributed(_worker, world, backend="nccl")
