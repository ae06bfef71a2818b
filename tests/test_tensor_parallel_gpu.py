"""Tensor parallelism's symmetric-memory all-reduce on two and four GPUs: the same sums as NCCL,
eagerly and replayed from a CUDA graph (chained calls, so a buffer reused too early would show),
and the same bits on every rank (ranks that disagreed would drift apart layer by layer)."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.gpu


def _chain(reduce, xs):
    # Each call's input depends on the previous result: consecutive all-reduces back to back,
    # as o_proj and down_proj of successive layers.
    y, outs = xs[0], []
    for x in xs[1:]:
        y = reduce(y)
        outs.append(y)
        y = y * 0.5 + x
    return outs


def _check(got, want, world):
    """got (symmetric memory) against want (NCCL), and got identical on every rank."""
    if world == 2:  # one addition each: the same bits whatever the order
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:  # the two may add in different orders: one rounding step apart at most
        torch.testing.assert_close(got, want)
    peers = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(peers, got)
    for p in peers:
        assert torch.equal(p, got), "ranks disagree"


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

        want = _chain(nccl, xs)
        got = _chain(sym, xs)
        for a, b in zip(got, want):
            _check(a, b, world)
        # The same chain captured once and replayed, with new inputs copied in between.
        static = [x.clone() for x in xs]
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            _chain(sym, static)
        torch.cuda.current_stream(device).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = _chain(sym, static)
        for _ in range(3):
            fresh = [torch.randn(1, 1, 8192, device=device, generator=g).to(dtype) for _ in xs]
            for dst, src in zip(static, fresh):
                dst.copy_(src)
            graph.replay()
            for a, b in zip(outs, _chain(nccl, fresh)):
                _check(a, b, world)
        # Larger than the buffer: NCCL in place.
        big = torch.ones(SymmetricMemoryAllReduce.MAX_BYTES // dtype.itemsize + 1, device=device,
                         dtype=dtype)
        assert torch.equal(sym(big), torch.full_like(big, float(world)))


@pytest.mark.parametrize("world", [2, 4])
def test_symmetric_memory_all_reduce_matches_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    run_distributed(_worker, world, backend="nccl")
