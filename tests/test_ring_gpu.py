"""Ring attention on GPUs: exact, and deterministic (the same bits as its blocks on one device).

- One GPU, exactness: every rank's ring plan (its blocks, merged into the float32 state by the
  kernel's epilogue) against an fp32 reference on the full sequence, causal zigzag with GQA.
- One GPU: the ring's per-step sequence (attention kernels merging into the float32 state in
  their epilogue, many launches back to back) gives the same bits as the same sequence with a
  device synchronisation after every call.
- Several GPUs (K/V by copy-engine push, and by NCCL send/recv): ring_attention, called
  repeatedly, with each step's transfer overlapping
  the previous step's compute, gives the same bits as its blocks run on one device.

Both once failed (when the ring ran attention, then merge_into): merge_into's in-place update
raced between the warps of a program when something else (the next kernel's early-launched
programs, NCCL's kernels) shared the SMs; see kernels/merge.py and tests/test_merge_gpu.py. The
attention kernel's fused merge has the same hazard and the same barrier."""

import pytest
import torch

import longctx
from longctx.parallel.ring import _step_blocks, ring_attention, shard_chunks, shard_sequence
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.gpu


def _ring_sequence(q, k, v, world: int, rank: int, sync: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s ring steps of a zigzag causal ring over `world` ranks, on one device (no
    communication): attention per block, merged into float32 accumulators."""
    S = q.shape[1]

    def shard(x, r):
        return torch.cat([x[:, a:a + n] for a, n in shard_chunks(S, world, r, "zigzag")], 1)

    mine = shard_chunks(S, world, rank, "zigzag")
    ql = shard(q, rank)
    o_acc = torch.zeros(ql.shape, device=q.device)
    lse_acc = torch.full(ql.shape[:3], float("-inf"), device=q.device)
    for t in range(world):
        src = (rank - t) % world
        kl, vl = shard(k, src), shard(v, src)
        for b in _step_blocks(mine, shard_chunks(S, world, src, "zigzag"), True):
            longctx.attention_merge_into(
                o_acc[:, b.q0:b.q1], lse_acc[:, b.q0:b.q1], ql[:, b.q0:b.q1], kl[:, b.k0:b.k1],
                vl[:, b.k0:b.k1], causal=b.masked, q_start=b.q_start, k_start=b.k_start)
            if sync:
                torch.cuda.synchronize()
    torch.cuda.synchronize()
    return o_acc, lse_acc


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_plan_matches_reference(world):
    """Within 2x the error of the one-device kernel call (same dtype) against fp32 SDPA."""
    g = torch.Generator(device="cuda").manual_seed(1)
    S, hq, hkv, d = 2 * world * 777, 8, 2, 128  # odd chunk length: ragged tiles in every block
    q = torch.randn(1, S, hq, d, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, S, hkv, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.float().transpose(1, 2) for x in (q, k, v)), is_causal=True, enable_gqa=True).transpose(1, 2)
    one, lse_one = longctx.attention(q, k, v, causal=True, return_lse=True)
    bar = 2 * (one.float() - ref).abs().max().item()
    for rank in range(world):
        chunks = shard_chunks(S, world, rank, "zigzag")
        o_acc, lse_acc = _ring_sequence(q, k, v, world, rank, sync=False)
        ref_r = torch.cat([ref[:, a:a + n] for a, n in chunks], 1)
        lse_r = torch.cat([lse_one[:, a:a + n] for a, n in chunks], 1)
        assert (o_acc.to(q.dtype).float() - ref_r).abs().max().item() <= bar, rank
        assert (lse_acc - lse_r).abs().max().item() < 1e-3, rank


def test_attention_merge_sequence_is_deterministic():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 32768, 32, 128, device="cuda", generator=g).to(torch.bfloat16)
               for _ in range(3))
    o_ref, lse_ref = _ring_sequence(q, k, v, 4, 0, sync=True)
    for _ in range(5):
        o, lse = _ring_sequence(q, k, v, 4, 0, sync=False)
        assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)


def _ring_worker(rank, world, transport="auto"):
    device = torch.device("cuda", rank)
    g = torch.Generator(device=device).manual_seed(0)  # the same full sequence on every rank
    q, k, v = (torch.randn(1, 131072, 32, 128, device=device, generator=g).to(torch.bfloat16)
               for _ in range(3))
    # First a shorter sequence, so that the full one grows the copy-engine ring's buffers.
    short = [x[:, :32768].contiguous() for x in (q, k, v)]
    o_short, _ = _ring_sequence(*short, world, rank, sync=True)
    o = ring_attention(*(shard_sequence(x) for x in short), causal=True, transport=transport)
    assert torch.equal(o, o_short.to(o.dtype)), f"{transport} rank {rank}: the shorter sequence"
    o_ref, _ = _ring_sequence(q, k, v, world, rank, sync=True)
    q_loc, k_loc, v_loc = (shard_sequence(x) for x in (q, k, v))
    for i in range(5):
        o = ring_attention(q_loc, k_loc, v_loc, causal=True, transport=transport)
        assert torch.equal(o, o_ref.to(o.dtype)), \
            f"{transport} rank {rank}, call {i}: max diff " \
            f"{(o.float() - o_ref).abs().max().item():.3e}"


@pytest.mark.parametrize("transport", ["copy_engine", "nccl"])
@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_its_blocks_on_one_device(world, transport):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    run_distributed(_ring_worker, world, transport, backend="nccl")
