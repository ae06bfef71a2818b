"""Tensor parallelism's push all-reduce (kernels/allreduce.py) on two and four GPUs, against the
unfused torch composition (the sum over ranks in float32, rounded; the residual add; RMSNorm):

- many calls in a row, plain sums and fused norms, 1-16 rows and back (each call clears the
  previous call's round: a larger call before a smaller one), eagerly, replayed from a CUDA
  graph with fresh inputs (7 calls per graph: not a multiple of the 3 rounds) and mixed;
- the GEMV that pushes its own output, then the fused norm that only waits (releasing the next
  kernel before or after its wait for the peers);
- the same bits on every rank; more than the buffers hold goes to NCCL;
- a stale read is caught: with one round's clearing undone on rank 0 and rank 1 late, rank 0's
  result must differ from the reference (the comparison would see a broken protocol).
"""

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.gpu

DIM = 8192  # CodeLlama-34B's width


def _torch_reference(partial, residual, weight, eps):
    """The composition the fused kernel replaces, in torch: every rank's partial summed in
    float32 in rank order and rounded (an all-reduce's result), residual + sum rounded, then
    RMSNorm in float32, rounded, times the weight (longctx.ops.rms_norm's order)."""
    parts = [torch.empty_like(partial) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, partial.contiguous())
    total = torch.stack(parts).float().sum(0).to(partial.dtype)
    if residual is None:
        return total
    h = (residual.float() + total.float()).to(partial.dtype)
    hf = h.float()
    n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return h, (weight.float() * n.float()).to(h.dtype)


def _check(got, want, what, weight=None, eps=1e-5):
    """Sums and new residuals exact (the same float32 sum in rank order, rounded once). The
    normed rows: their error against the norm in float64 of those exact residuals at most
    twice that of the torch composition in the dtype (rsqrt and the mean's order differ). The
    same bits on every rank."""
    pairs = list(zip(got, want)) if isinstance(want, tuple) else [(got, want)]
    g, w = pairs[0]
    assert torch.equal(g, w), f"{what}: sum off by {(g.float() - w.float()).abs().max():.3e}"
    if len(pairs) == 2:
        h = g.double()
        exact = weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        err = (pairs[1][0].double() - exact).abs().max().item()
        bar = (pairs[1][1].double() - exact).abs().max().item()
        assert err <= 2 * bar, f"{what}: norm error {err:.3e} > 2 x torch's {bar:.3e}"
    for g, _ in pairs:
        everyone = [torch.empty_like(g) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, g.contiguous())
        assert all(torch.equal(e, g) for e in everyone), f"{what}: ranks disagree"


ROWS = [1, 8, 1, 3, 16, 2, 1]  # 7 calls: a larger call's round cleared before a smaller one


def _inputs(rows, dtype, gens):
    """Fresh partials (rank-dependent generator) and residuals (the same on every rank, as the
    model's residual stream is)."""
    mine, shared = gens
    dev = mine.device
    partial = [torch.randn(m, DIM, device=dev, generator=mine).to(dtype) for m in rows]
    for p in partial:
        p[:, :5] = -0.0  # the mark's value
    residual = [torch.randn(m, DIM, device=dev, generator=shared).to(dtype) for m in rows]
    return partial, residual


def _calls(comm, partial, residual, weight):
    """Alternately fused norms and plain sums over the list of inputs."""
    out = []
    for i, (p, r) in enumerate(zip(partial, residual)):
        out.append(comm.add_rms_norm(r, p, weight, 1e-5) if i % 2 == 0 else comm.all_reduce(p))
    return out


def _check_calls(out, partial, residual, weight, what):
    for i, (o, p, r) in enumerate(zip(out, partial, residual)):
        _check(o, _torch_reference(p, r if i % 2 == 0 else None, weight, 1e-5),
               f"{what}, call {i} ({p.shape[0]} rows)", weight)


def _worker(rank, world):
    from longctx.kernels.gemv import gemv, skinny_gemm
    from longctx.parallel.allreduce import PushAllReduce

    device = torch.device("cuda", rank)
    group = dist.group.WORLD
    for dtype in (torch.bfloat16, torch.float32):
        comm = PushAllReduce.symmetric(group, device, dtype, DIM)
        g = torch.Generator(device=device).manual_seed(10 + rank)
        gens = (g, torch.Generator(device=device).manual_seed(5))
        weight = (1 + 0.1 * torch.randn(DIM, device=device, generator=gens[1])).to(dtype)
        for rep in range(3):  # eager
            partial, residual = _inputs(ROWS, dtype, gens)
            _check_calls(_calls(comm, partial, residual, weight), partial, residual, weight,
                         f"{dtype} eager {rep}")
        # Captured once, replayed with fresh inputs, eager calls in between.
        static_p, static_r = _inputs(ROWS, dtype, gens)
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            _calls(comm, static_p, static_r, weight)
        torch.cuda.current_stream(device).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _calls(comm, static_p, static_r, weight)
        for rep in range(20):
            fresh_p, fresh_r = _inputs(ROWS, dtype, gens)
            for dst, src in zip(static_p + static_r, fresh_p + fresh_r):
                dst.copy_(src)
            graph.replay()
            _check_calls(out, fresh_p, fresh_r, weight, f"{dtype} replay {rep}")
            if rep % 5 == 4:
                partial, residual = _inputs(ROWS[:2], dtype, gens)
                _check_calls(_calls(comm, partial, residual, weight), partial, residual, weight,
                             f"{dtype} eager after replay {rep}")
        if dtype != torch.float32:
            # The GEMV (1 row) or the skinny GEMM (8 rows) pushes its output; the fused norm
            # only waits (eager and in a graph).
            K = 4096
            w = torch.randn(DIM, K, device=device, generator=g).to(dtype) / K ** 0.5
            for rows in (1, 8):
                x = torch.randn(rows, K, device=device, generator=g).to(dtype)
                r = torch.randn(rows, DIM, device=device, generator=gens[1]).to(dtype)
                project = gemv if rows == 1 else skinny_gemm

                def pushed_layer():
                    p = project(x, w, push=comm.bufs)
                    return p, comm.add_rms_norm(r, p, weight, 1e-5, pushed=True)

                rule = comm.early
                for early in (rule, not rule):  # both points where the next kernel is released
                    comm.early = early
                    for rep in range(5):
                        p, got = pushed_layer()
                        _check(got, _torch_reference(p, r, weight, 1e-5),
                               f"{rows}-row push eager {rep} (early={early})", weight)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        p, got = pushed_layer()
                    for rep in range(10):
                        x.copy_(torch.randn(rows, K, device=device, generator=g))
                        graph.replay()
                        _check(got, _torch_reference(p, r, weight, 1e-5),
                               f"{rows}-row push replay {rep} (early={early})", weight)
                comm.early = rule
        # Larger than a slot: NCCL in place.
        big = torch.ones(comm.bufs.slot + DIM, device=device, dtype=dtype)
        assert torch.equal(comm.all_reduce(big), torch.full_like(big, float(world)))
    # Last: a broken protocol must show. Undo rank 0's clearing of the next round (as a missed
    # clear would leave it) and make rank 1 late: rank 0 then sums stale data.
    from longctx.kernels.allreduce import ROUNDS

    torch.cuda.synchronize(device)
    dist.barrier()
    count = int(comm.bufs.flags[0])
    if rank == 0:
        buf = comm.bufs.buf.view(ROUNDS, world, -1)
        buf[count % ROUNDS, :, :DIM].copy_(torch.randn(world, DIM, device=device).view(buf.dtype))
    torch.cuda.synchronize(device)
    dist.barrier()
    partial = torch.randn(1, DIM, device=device, dtype=comm.dtype)
    if rank == 1:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before its push
    got = comm.all_reduce(partial)
    want = _torch_reference(partial, None, None, 0.0)
    stale = torch.tensor([0 if torch.equal(got, want) else 1], device=device)
    if rank == 0:
        assert int(stale) == 1, "rank 0 read a round whose clearing was undone, yet matched"


@pytest.mark.parametrize("world", [2, 4])
def test_push_all_reduce_against_torch(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    run_distributed(_worker, world, backend="nccl")
