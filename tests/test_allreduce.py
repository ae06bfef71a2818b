"""The push all-reduce (kernels/allreduce.py, longctx.parallel.allreduce) on the CPU: each rank a
process running the kernel under the Triton interpreter, the buffers shared files mapped by
every rank (where GPUs map symmetric memory). Checked call by call against the unfused torch
composition (the sum over ranks, the residual add, RMSNorm) on fresh random data: plain sums
and fused norms, varying row counts (the rounds' clearing of a larger previous call), -0.0 in
the data (the "not arrived" mark), a message too large for the buffers (NCCL's path, here
gloo), and the row-parallel GEMV pushing its output itself. A test then breaks the clearing
on purpose and checks that the comparison catches the stale read."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

N = 40  # a row width that is not a power of two: masked lanes
ROWS = [1, 3, 1, 2, 4, 1, 1, 2]  # varying sizes; 4 rows fill a slot


def _setup(rank, world, tmp, dtype):
    from longctx.kernels.allreduce import ROUNDS, PushBuffers, mark_dtype
    from longctx.parallel.allreduce import PushAllReduce

    slot = 4 * N
    idt, mark = mark_dtype(dtype)
    paths = [os.path.join(tmp, f"buf{r}") for r in range(world)]
    size = ROUNDS * world * slot
    mine = torch.from_file(paths[rank], shared=True, size=size, dtype=idt)
    mine.fill_(mark)
    dist.barrier()
    bufs = [torch.from_file(p, shared=True, size=size, dtype=idt) for p in paths]
    bufs[rank] = mine
    handle = PushBuffers.from_addresses(mine, [b.data_ptr() for b in bufs], rank, slot)
    return PushAllReduce(dist.group.WORLD, handle, dtype, bufs), bufs


def _reference(partial, residual, weight, eps):
    """The unfused composition: every rank's partial (all_gather), summed in float32 in rank
    order and rounded (an all-reduce's result), then longctx.ops.rms_norm with the add."""
    from longctx.ops import rms_norm

    parts = [torch.empty_like(partial) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, partial)
    total = torch.stack(parts).float().sum(0).to(partial.dtype)
    if residual is None:
        return total
    return rms_norm(residual, weight, eps, total)


def _errors(got, want):
    """(max error of the sum or new residual, max error of the normed row)."""
    if isinstance(want, torch.Tensor):
        return (got.float() - want.float()).abs().max().item(), 0.0
    return tuple((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))


def _data(step, rank, M, dtype):
    g = torch.Generator().manual_seed(1000 * step + rank)
    partial = torch.randn(M, N, generator=g).to(dtype)
    partial[:, :3] = -0.0  # the mark's value: must arrive as a zero, not hang the peers
    g.manual_seed(1000 * step + 999)  # the residual and weight are the same on every rank
    residual = torch.randn(M, N, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype)
    return partial, residual, weight


def _worker(rank, world, tmp, dtype_name):
    dtype = getattr(torch, dtype_name)
    comm, _ = _setup(rank, world, tmp, dtype)
    tol = 2e-3 if dtype == torch.float16 else 1e-6
    for step, M in enumerate(ROWS + [5]):  # 5 rows exceed the slot: gloo, then the push again
        partial, residual, weight = _data(step, rank, M, dtype)
        fused = step % 2 == 0
        want = _reference(partial, residual if fused else None, weight, 1e-5)
        if fused:
            got = comm.add_rms_norm(residual, partial.clone(), weight, 1e-5)
        else:
            got = comm.all_reduce(partial.clone())
        sum_err, norm_err = _errors(got, want)
        # The push kernel sums in float32 in rank order: exactly the reference's bits. gloo
        # (the 5 rows) adds in the dtype, in an order of its own.
        sum_tol = 0 if M <= 4 else tol * world
        assert sum_err <= sum_tol, f"rank {rank} step {step} ({M} rows): sum off by {sum_err}"
        assert norm_err <= tol, f"rank {rank} step {step}: norm off by {norm_err}"
    assert int(comm.bufs.flags[0]) == len(ROWS), "one count per pushed call (5 rows went to gloo)"


def _gemv_worker(rank, world, tmp, dtype_name):
    """Row-parallel projections that push their own output, each followed by the fused norm or
    the plain sum: the GEMV (1 row) and the skinny GEMM (2-4 rows), called directly and through
    `linear` with push_gemv (which must take the pushing kernel for both)."""
    from longctx.backend import force_triton
    from longctx.kernels.gemv import gemv, skinny_gemm

    dtype = getattr(torch, dtype_name)
    comm, _ = _setup(rank, world, tmp, dtype)
    comm.push_gemv = True
    K = 24
    with force_triton():
        for step, M in enumerate([1, 2, 1, 4, 3, 1, 2, 4]):
            _, residual, weight = _data(step, rank, M, dtype)
            g = torch.Generator().manual_seed(77 * step + rank)
            x = torch.randn(M, K, generator=g).to(dtype)
            w = torch.randn(N, K, generator=g).to(dtype)
            direct = step < 5
            if direct:
                partial = (gemv if M == 1 else skinny_gemm)(x, w, push=comm.bufs)
            else:  # add_rms_norm / all_reduce know from linear that it pushed
                partial = comm.linear(x, w)
                assert comm._pushed is partial, f"step {step}: linear did not push ({M} rows)"
            fused = direct or step % 2 == 0
            if fused:
                got = comm.add_rms_norm(residual, partial, weight, 1e-5, pushed=direct)
            else:
                got = comm.all_reduce(partial)
            want = _reference(partial, residual if fused else None, weight, 1e-5)
            sum_err, norm_err = _errors(got, want)
            assert sum_err == 0 and norm_err <= 2e-3, \
                f"rank {rank} step {step} ({M} rows): {sum_err}, {norm_err}"


def _model_worker(rank, world, tmp):
    """A tp=2 decoder (float16, the Triton kernels under the interpreter) whose sums go through
    the push kernel, the GEMVs pushing their own output: the logits of gloo's sums, step by
    step (the same sums rounded once; the norms' rounding may differ)."""
    from longctx.backend import force_triton
    from longctx.config import ModelArgs
    from longctx.parallel.build import build_model
    from longctx.parallel.mesh import ParallelDims
    from longctx.parallel.sampling import full_logits
    from longctx.weights import RandomWeights

    args = ModelArgs(n_layers=2, dim=N, n_heads=4, n_kv_heads=2, head_dim=16,
                     intermediate_size=48, vocab_size=64, name="test")
    mesh = ParallelDims(2, 1, world).build_mesh("cpu")
    model = build_model(args, weights=RandomWeights(seed=3), device="cpu", dtype=torch.float16,
                        batch=1, max_seq_len=8, mesh=mesh)
    comm, _ = _setup(rank, world, tmp, torch.float16)
    comm.push_gemv = True
    gloo = model.norm.comm
    prompt = torch.randint(0, args.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    logits = {}
    with torch.no_grad(), force_triton():
        for name, c in (("gloo", gloo), ("push", comm)):
            for m in model.modules():
                if hasattr(m, "comm"):
                    m.comm = c
            model.setup_caches(1, 8)
            steps = [full_logits(model, model.prefill(prompt, torch.arange(5)))]
            for i in range(2):
                tok, pos = prompt[:, i], torch.full((1,), 5 + i)
                steps.append(full_logits(model, model.decode_step(tok, pos)))
            logits[name] = steps
    assert int(comm.bufs.flags[0]) > 0, "the push kernel ran"
    for i, (a, b) in enumerate(zip(logits["push"], logits["gloo"])):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=lambda m: f"step {i}: {m}")


def _stale_worker(rank, world, tmp, dtype_name, result_path):
    """Rank 0 finds its next round holding the data of an earlier call (its clearing undone)
    while rank 1 is late: rank 0 reads the stale values. The comparison must see it."""
    from longctx.kernels.allreduce import ROUNDS

    dtype = getattr(torch, dtype_name)
    comm, bufs = _setup(rank, world, tmp, dtype)
    for step in range(ROUNDS):  # every round used once
        partial, residual, weight = _data(step, rank, 1, dtype)
        comm.all_reduce(partial.clone())
    dist.barrier()
    if rank == 0:  # undo the clearing of round 0 (the next call's), as a missed clear would
        used = bufs[0].view(ROUNDS, world, -1)[0, :, :N]
        used.copy_(torch.randn(world, N).to(dtype).view(used.dtype))
    dist.barrier()
    partial, _, _ = _data(ROUNDS, rank, 1, dtype)
    if rank == 1:
        time.sleep(1.0)
    got = comm.all_reduce(partial.clone())
    err = _errors(got, _reference(partial, None, None, 0.0))[0]
    if rank == 0:
        with open(result_path, "w") as f:
            f.write(repr(err))


@pytest.mark.interpreter
@pytest.mark.parametrize("world, dtype", [(2, "float16"), (3, "float32")])
def test_push_all_reduce_matches_torch(tmp_path, world, dtype):
    run_distributed(_worker, world, str(tmp_path), dtype)


def test_make_all_reduce_kinds():
    """NCCL (gloo) off CUDA; the push kinds refuse a CPU device, unknown kinds are named."""
    from longctx.parallel.allreduce import NcclAllReduce, make_all_reduce

    for kind in ("auto", "nccl"):
        assert type(make_all_reduce(None, torch.device("cpu"), torch.float32, 8, kind)) is NcclAllReduce
    for kind in ("push", "push_gemv"):
        with pytest.raises(ValueError, match=f"parallel.all_reduce={kind} needs CUDA"):
            make_all_reduce(None, torch.device("cpu"), torch.float32, 8, kind)
    with pytest.raises(ValueError, match="parallel.all_reduce must be one of"):
        make_all_reduce(None, torch.device("cpu"), torch.float32, 8, "torch")


@pytest.mark.interpreter
def test_gemv_and_skinny_push_then_sum(tmp_path):
    run_distributed(_gemv_worker, 2, str(tmp_path), "float16")


@pytest.mark.interpreter
def test_tp2_model_with_push_sums_matches_gloo(tmp_path):
    run_distributed(_model_worker, 2, str(tmp_path))


@pytest.mark.interpreter
def test_a_stale_read_is_caught(tmp_path):
    result = tmp_path / "err"
    run_distributed(_stale_worker, 2, str(tmp_path), "float16", str(result))
    assert float(result.read_text()) > 0, "rank 0 read stale data, yet matched the reference"


def test_push_all_reduce_refuses_a_bad_num_warps():
    from longctx.kernels.allreduce import ROUNDS, PushBuffers, mark_dtype, push_all_reduce

    idt, mark = mark_dtype(torch.float16)
    buf = torch.full((ROUNDS * 16,), mark, dtype=idt)
    bufs = PushBuffers.from_addresses(buf, [buf.data_ptr()], 0, 16)
    with pytest.raises(ValueError, match="num_warps must be a power of two from 1 to 32, got 3"):
        push_all_reduce(torch.zeros(1, 16, dtype=torch.float16), bufs, num_warps=3)


def test_pushing_projections_refuse_what_they_cannot_push():
    """A pushed output is a row-parallel partial: a bias (added once per rank), a gated GEMV or
    more outputs than a slot holds are refused, naming what is wrong."""
    from longctx.kernels.allreduce import ROUNDS, PushBuffers, mark_dtype
    from longctx.kernels.gemv import gemv, skinny_gemm

    idt, mark = mark_dtype(torch.float16)
    buf = torch.full((ROUNDS * 64,), mark, dtype=idt)
    bufs = PushBuffers.from_addresses(buf, [buf.data_ptr()], 0, 64)
    w, b = torch.zeros(32, 16, dtype=torch.float16), torch.zeros(32, dtype=torch.float16)
    x1, x4 = torch.zeros(1, 16, dtype=torch.float16), torch.zeros(4, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="bias=given"):
        gemv(x1, w, bias=b, push=bufs)
    with pytest.raises(ValueError, match="gated=True"):
        gemv(x1, w, gated=True, push=bufs)
    with pytest.raises(ValueError, match="at most 64 outputs, got 128"):
        gemv(x1, torch.zeros(128, 16, dtype=torch.float16), push=bufs)
    with pytest.raises(ValueError, match="takes no bias"):
        skinny_gemm(x4, w, bias=b, push=bufs)
    with pytest.raises(ValueError, match="pushes at most 64 elements, got 4 x 32"):
        skinny_gemm(x4, w, push=bufs)
