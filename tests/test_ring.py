"""Ring attention: every rank's output shard, unsharded, equals float64 reference attention over the
full sequence (W = 1..4, W = 3 on a subgroup; causal or not, zigzag and contiguous, GQA); K/V shards are left as they
were; the layouts hold the chunks they promise; bad lengths, layouts and shards raise ValueError;
the launcher runs end to end. One spawned gloo job per world size keeps process start-up cheap."""

import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from longctx.backend import force_triton
from longctx.parallel import ring_attention, shard_sequence, unshard_sequence
from longctx.parallel.ring import LAYOUTS, _step_blocks, shard_chunks
from longctx.reference import reference_attention
from tests.dist_utils import run_distributed

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]


def _expected_positions(seq_len: int, world: int, rank: int, layout: str) -> list[int]:
    """Written out independently of shard_chunks: which absolute positions a rank holds."""
    if world == 1:
        return list(range(seq_len))
    if layout == "contiguous":
        n = seq_len // world
        return list(range(rank * n, (rank + 1) * n))
    c = seq_len // (2 * world)
    j = 2 * world - 1 - rank
    return list(range(rank * c, (rank + 1) * c)) + list(range(j * c, (j + 1) * c))


def _check_ring(rank, world, group, *, B, S, Hq, Hkv, D, causal, layout, dtype, scale, atol):
    """Full q/k/v (same on every rank: same seed), sharded; compare the unsharded ring output."""
    gen = torch.Generator().manual_seed(1000 * S + 10 * Hq + causal)
    q, k, v = (torch.randn(B, S, h, D, generator=gen, dtype=F64) for h in (Hq, Hkv, Hkv))
    o_ref, lse_ref = reference_attention(q, k, v, causal=causal, softmax_scale=scale,
                                         compute_dtype=F64)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    ql, kl, vl = (shard_sequence(x, group, layout) for x in (q, k, v))
    g_rank = dist.get_rank(group)
    pos = _expected_positions(S, world, g_rank, layout)
    assert torch.equal(ql, q[:, pos]) and torch.equal(kl, k[:, pos]), (layout, world)
    kl0, vl0 = kl.clone(), vl.clone()

    o_loc, lse_loc = ring_attention(ql, kl, vl, group=group, causal=causal, layout=layout,
                                    softmax_scale=scale, return_lse=True)
    assert o_loc.shape == ql.shape and o_loc.dtype == dtype
    assert lse_loc.shape == (B, S // world, Hq)
    assert lse_loc.dtype == (F64 if dtype == F64 else torch.float32)
    assert torch.equal(kl, kl0) and torch.equal(vl, vl0), "K/V shards must be left untouched"
    o = unshard_sequence(o_loc, group, layout)
    lse = unshard_sequence(lse_loc, group, layout)
    torch.testing.assert_close(o.to(F64), o_ref, rtol=0, atol=atol)
    torch.testing.assert_close(lse.to(F64), lse_ref, rtol=0, atol=atol)
    assert torch.equal(unshard_sequence(ql, group, layout), q)  # round trip
    o_only = ring_attention(ql, kl, vl, group=group, causal=causal, layout=layout,
                            softmax_scale=scale)
    torch.testing.assert_close(o_only, o_loc, rtol=0, atol=0)


def _bad_input(rank, world):
    x = torch.randn(1, 2 * world * 3 + 1, 2, 16, dtype=F64)
    ql, kl, vl = (shard_sequence(x[:, :-1], None, "zigzag") for _ in range(3))
    with pytest.raises(ValueError, match=r"layout must be one of 'zigzag', 'contiguous', got 'ring'"):
        ring_attention(ql, kl, vl, layout="ring")
    with pytest.raises(ValueError, match=r"causal must be True or False, got 'no'"):
        ring_attention(ql, kl, vl, causal="no")
    with pytest.raises(ValueError, match=r"transport must be one of 'auto', 'copy_engine', 'nccl', got 'tcp'"):
        ring_attention(ql, kl, vl, transport="tcp")
    with pytest.raises(ValueError, match=r"transport='copy_engine' needs CUDA tensors"):
        ring_attention(ql, kl, vl, transport="copy_engine")
    with pytest.raises(ValueError, match=r"q.shape\[1\] .* is 5, but layout 'zigzag' needs"):
        ring_attention(ql[:, :5], kl[:, :5], vl[:, :5])
    with pytest.raises(ValueError, match="same local sequence length"):
        ring_attention(ql, kl[:, :4], vl[:, :4])
    with pytest.raises(ValueError, match=r"length 13 must be divisible by 4 for layout 'zigzag'"):
        shard_sequence(x, None, "zigzag")
    with pytest.raises(ValueError, match=r"x.shape\[1\] .* is 3, but layout 'zigzag'"):
        unshard_sequence(ql[:, :3], None, "zigzag")
    # Shards that differ across ranks: every rank raises (no rank is left waiting in a P2P).
    n = 6 if rank == 0 else 4
    with pytest.raises(ValueError, match=r"inconsistent across ranks: rank 0: q.shape=\[1, 6"):
        ring_attention(ql[:, :n], kl[:, :n], vl[:, :n])
    with pytest.raises(ValueError, match="inconsistent across ranks"):
        ring_attention(ql, kl, vl, causal=rank == 0)
    with pytest.raises(ValueError, match="inconsistent across ranks"):
        unshard_sequence(ql[:, :n], None, "zigzag")
    # dtypes the attention never takes still differ (int32 and int64 had the same check id)
    ints = torch.zeros(1, 4, dtype=torch.int32 if rank == 0 else torch.int64)
    with pytest.raises(ValueError, match="inconsistent across ranks"):
        unshard_sequence(ints, None, "contiguous")
    for bad in (4, -5):  # dim outside x's dims (unshard used to wrap it around)
        with pytest.raises(ValueError, match=r"dim must be an int in \[-4, 4\)"):
            shard_sequence(x[:, :-1], None, "zigzag", dim=bad)
        with pytest.raises(ValueError, match=r"dim must be an int in \[-4, 4\)"):
            unshard_sequence(ql, None, "zigzag", dim=bad)
    with pytest.raises(ValueError, match="x must be a torch.Tensor"):
        shard_sequence(x[:, :-1].tolist(), None, "zigzag")


def test_shard_sequence_one_rank_is_contiguous():
    """The docstring's 'a new contiguous tensor' also for an input in another memory format
    (one rank, no process group: torch.cat kept channels_last)."""
    x = torch.randn(1, 8, 2, 16).to(memory_format=torch.channels_last)
    for layout in LAYOUTS:
        y = shard_sequence(x, None, layout)
        assert y.is_contiguous() and torch.equal(y, x) and y.data_ptr() != x.data_ptr()


def _matrix(rank, world, group):
    """Layouts x causal x (GQA 4:1, MHA) in float64, and one float32 case, on `group`."""
    for layout in LAYOUTS:
        for causal in (True, False):
            for Hq, Hkv in ((4, 1), (2, 2)):
                # chunks of 3 tokens: odd, nothing a power of two; B = 2
                _check_ring(rank, world, group, B=2, S=2 * world * 3, Hq=Hq, Hkv=Hkv, D=16,
                            causal=causal, layout=layout, dtype=F64, scale=None, atol=1e-10)
    # float32 inputs: float32 output and LSE (float32 accumulator), a custom softmax scale
    _check_ring(rank, world, group, B=1, S=2 * world * 8, Hq=4, Hkv=2, D=32, causal=True,
                layout="zigzag", dtype=torch.float32, scale=0.3, atol=2e-5)


def _kernel_path(rank, world):
    """The ring on the Triton kernel (interpreter on CPU): its fused merge into an uninitialised
    float32 accumulator (`attention_merge_into`), causal zigzag and unmasked contiguous, GQA,
    head_dim 32 and 40 (a tile of 64, padded). tests/test_ring_gpu.py checks the ring's plan on
    the compiled kernel."""
    torch.set_num_threads(1)
    with force_triton():
        for causal, layout, d in ((True, "zigzag", 32), (False, "contiguous", 40)):
            _check_ring(rank, world, None, B=1, S=2 * world * 8, Hq=4, Hkv=2, D=d,
                        causal=causal, layout=layout, dtype=torch.float32, scale=None, atol=2e-5)


def _ring_world(rank, world):
    torch.set_num_threads(1)  # W processes share the test machine's few cores
    if world == 2:
        _bad_input(rank, world)
    _matrix(rank, world, None)
    if world == 4:
        # W = 3 on the subgroup of global ranks 1..3: group ranks differ from global ranks, so
        # the P2P peers must be mapped (and a separate 3-process job would cost ~10 s to spawn).
        sub = dist.new_group([1, 2, 3], timeout=timedelta(seconds=60))
        if rank in (1, 2, 3):
            _matrix(rank, 3, sub)
        dist.barrier()  # rank 0 hosts the store: it must outlive the subgroup's work


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_attention_matches_reference(world):
    """W = 1, 2, 4 on the world group; with W = 2 also bad input; with W = 4 also W = 3 on a
    3-rank subgroup."""
    run_distributed(_ring_world, world)


@pytest.mark.interpreter
def test_ring_attention_on_the_kernels_matches_reference():
    run_distributed(_kernel_path, 2)


def test_shard_chunks_and_bad_lengths():
    assert shard_chunks(12, 3, 1, "zigzag") == [(2, 2), (8, 2)]
    assert shard_chunks(12, 3, 1, "contiguous") == [(4, 4)]
    assert shard_chunks(7, 1, 0, "zigzag") == [(0, 7)]  # one rank: any length
    with pytest.raises(ValueError, match=r"length 10 must be divisible by 6 for layout 'zigzag' on 3 ranks"):
        shard_chunks(10, 3, 0, "zigzag")
    with pytest.raises(ValueError, match=r"length 10 must be divisible by 4 for layout 'contiguous'"):
        shard_chunks(10, 4, 0, "contiguous")
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_chunks(12, 2, 0, "striped")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world", [2, 3, 5])
def test_plan_skips_masked_pairs_and_zigzag_balances(world, causal):
    """Count the query x key cells each rank computes per step: every visible cell once, fully
    masked chunk pairs never, each block's mask the true one (no mask without causal); zigzag
    gives every rank the same work at every step, in one call per step."""
    S = 2 * world * 4
    for layout in LAYOUTS:
        per_rank = []
        for r in range(world):
            qc = shard_chunks(S, world, r, layout)
            q_pos = [a + i for a, n in qc for i in range(n)]
            steps = []
            for t in range(world):
                kc = shard_chunks(S, world, (r - t) % world, layout)
                k_pos = [a + i for a, n in kc for i in range(n)]
                cells = 0
                blocks = _step_blocks(qc, kc, causal=causal)
                if layout == "zigzag":
                    assert len(blocks) == 1  # one kernel call per step
                for b in blocks:
                    qs, ks = q_pos[b.q0:b.q1], k_pos[b.k0:b.k1]
                    visible = sum(kp <= qp or not causal for qp in qs for kp in ks)
                    if b.masked:  # the kernel's mask on the block's positions is the true one
                        assert causal
                        assert all((b.q_start + i >= b.k_start + j) == (kp <= qp)
                                   for i, qp in enumerate(qs) for j, kp in enumerate(ks))
                    else:
                        assert visible == len(qs) * len(ks)  # unmasked blocks see every key
                    assert visible > 0  # a fully masked pair is never computed
                    cells += visible
                steps.append(cells)
            per_rank.append(steps)
        # each visible (q, k) pair once
        assert sum(map(sum, per_rank)) == (S * (S + 1) // 2 if causal else S * S)
        if layout == "zigzag":
            assert all(steps == per_rank[0] for steps in per_rank), per_rank


def test_ring_without_process_group_is_attention():
    assert not dist.is_initialized()
    q, k, v = torch.randn(2, 7, 4, 16), torch.randn(2, 7, 2, 16), torch.randn(2, 7, 2, 16)
    o, lse = ring_attention(q, k, v, causal=True, return_lse=True)
    ro, rlse = reference_attention(q, k, v, causal=True)
    torch.testing.assert_close(o, ro, rtol=0, atol=0)
    torch.testing.assert_close(lse, rlse, rtol=0, atol=0)


def test_prefill_launcher_two_ranks_on_cpu():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "launch/prefill.py", "seq_len=256", "q_heads=4", "kv_heads=2", "warmup=0", "iters=1"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # CPU and gloo even on a GPU machine (two ranks need not have two GPUs there)
    res = subprocess.run(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert out.count("ring prefill | 2 rank(s), gloo") == 1, out  # rank 0 prints, once
    assert re.search(r"ring +[\d.]+ ms/call +[\d.]+ TFLOPS per rank", out), out
    assert "parallel efficiency" in out, out
    err = re.search(r"max \|O err\| vs one device: (\S+) +max \|LSE err\|: (\S+)", out)
    assert err and float(err.group(1)) < 1e-5 and float(err.group(2)) < 1e-5, out
