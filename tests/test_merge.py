"""The merge layer: exactness against attention over the whole KV, invariances, empty states,
bad LSE values, the Triton kernel (interpreter on CPU) against the torch merge, and the
process-group merge on gloo."""

import math
import random

import pytest
import torch

from longctx import merge_into, merge_states, merge_states_group
from longctx.backend import force_triton
from longctx.merge import merge_states_torch
from longctx.reference import reference_attention
from tests.dist_utils import run_distributed

F64 = torch.float64


def _random_cuts(n: int, parts: int, rng: random.Random) -> list[int]:
    """Boundaries 0 = c0 <= c1 <= ... <= c_parts = n: parts may be empty or of size 1."""
    inner = sorted(rng.choice([0, 1, n - 1, n] + [rng.randrange(n + 1) for _ in range(3)])
                   for _ in range(parts - 1))
    return [0, *inner, n]


def _part_states(q, k, v, cuts, causal, q_start):
    os_, lses = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        o, lse = reference_attention(q, k[:, a:b], v[:, a:b], causal=causal, q_start=q_start,
                                     k_start=a, compute_dtype=F64)
        os_.append(o)
        lses.append(lse)
    return torch.stack(os_), torch.stack(lses)


@pytest.mark.parametrize("parts", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("causal", [False, True])
def test_merge_of_partitions_equals_full_attention(parts, causal):
    rng = random.Random(parts * 10 + causal)
    B, Sq, Hq, Hkv, D, Sk = 2, 5, 6, 2, 16, 37
    q = torch.randn(B, Sq, Hq, D, dtype=F64)
    k = torch.randn(B, Sk, Hkv, D, dtype=F64)
    v = torch.randn(B, Sk, Hkv, D, dtype=F64)
    q_start = 20  # causal: early queries see only some parts, some parts are masked out
    o_ref, lse_ref = reference_attention(q, k, v, causal=causal, q_start=q_start, compute_dtype=F64)
    cuts = _random_cuts(Sk, parts, rng)
    o_p, lse_p = _part_states(q, k, v, cuts, causal, q_start)
    o, lse = merge_states(o_p, lse_p)
    assert o.dtype == F64 and lse.dtype == F64
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=1e-12)


def test_merge_is_order_and_grouping_invariant():
    rng = random.Random(7)
    P = 7
    o = torch.randn(P, 3, 4, 8, dtype=F64)
    lse = torch.randn(P, 3, 4, dtype=F64) * 5
    lse[2] = float("-inf")  # one empty part
    ref_o, ref_lse = merge_states(o, lse)
    perm = list(range(P))
    rng.shuffle(perm)
    po, plse = merge_states(o[perm], lse[perm])
    torch.testing.assert_close(po, ref_o, rtol=0, atol=1e-12)
    torch.testing.assert_close(plse, ref_lse, rtol=0, atol=1e-12)
    # ((0..2) (3..6)) grouped, then merged
    a = merge_states(o[:3], lse[:3])
    b = merge_states(o[3:], lse[3:])
    go, glse = merge_states(torch.stack([a[0], b[0]]), torch.stack([a[1], b[1]]))
    torch.testing.assert_close(go, ref_o, rtol=0, atol=1e-12)
    torch.testing.assert_close(glse, ref_lse, rtol=0, atol=1e-12)
    # left fold with merge_into from the empty state
    acc_o = torch.zeros_like(o[0])
    acc_lse = torch.full_like(lse[0], float("-inf"))
    for i in perm:
        merge_into(acc_o, acc_lse, o[i], lse[i])
    torch.testing.assert_close(acc_o, ref_o, rtol=0, atol=1e-12)
    torch.testing.assert_close(acc_lse, ref_lse, rtol=0, atol=1e-12)


def test_empty_parts_contribute_nothing_and_all_empty_is_empty():
    o = torch.randn(4, 2, 3, 8)
    lse = torch.randn(4, 2, 3)
    lse[1] = float("-inf")
    o[1] = float("nan")  # an empty part's O is never read
    mo, mlse = merge_states(o, lse)
    ro, rlse = merge_states(o[[0, 2, 3]], lse[[0, 2, 3]])
    torch.testing.assert_close(mo, ro)
    torch.testing.assert_close(mlse, rlse)

    lse_empty = torch.full((3, 2, 3), float("-inf"))
    o_empty = torch.randn(3, 2, 3, 8)
    eo, else_ = merge_states(o_empty, lse_empty)
    assert torch.equal(eo, torch.zeros_like(eo))
    assert torch.isneginf(else_).all()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_bad_lse_raises(bad):
    o = torch.randn(2, 3, 4, 8)
    lse = torch.randn(2, 3, 4)
    lse[1, 2, 0] = bad
    with pytest.raises(ValueError, match="lse"):
        merge_states(o, lse)
    with pytest.raises(ValueError, match="lse"):
        merge_into(torch.zeros(3, 4, 8), torch.zeros(3, 4), o[1], lse[1])


def test_shape_and_dtype_errors():
    with pytest.raises(ValueError, match="lse"):
        merge_states(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="lse"):
        merge_states(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4).half())
    with pytest.raises(ValueError, match="at least one part"):
        merge_states(torch.randn(0, 3, 4, 8), torch.randn(0, 3, 4))
    with pytest.raises(ValueError, match="o_acc"):
        merge_into(torch.zeros(3, 4, 8).half(), torch.zeros(3, 4), torch.randn(3, 4, 8),
                   torch.randn(3, 4))
    with pytest.raises(ValueError, match="o "):
        merge_into(torch.zeros(3, 4, 8), torch.zeros(3, 4), torch.randn(2, 4, 8),
                   torch.randn(2, 4))


def _states(P, rows, H, D, dtype, empty_frac=0.3, device="cpu"):
    o = torch.randn(P, rows, H, D).to(device=device, dtype=dtype)
    lse = torch.randn(P, rows, H, device=device) * 4
    lse[torch.rand(P, rows, H, device=device) < empty_frac] = float("-inf")
    lse[:, 0, 0] = float("-inf")  # one row where every part is empty
    return o, lse


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("P", [1, 3, 9, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [64, 128, 40, 96])  # 40: a head_dim chunk of 32 partly masked
def test_merge_kernel_matches_torch(P, dtype, D, device):
    """Empty parts' O holds NaN: the kernel loads it (beside its LSE) but must not use it."""
    o, lse = _states(P, 3, 5, D, dtype, device=device)
    ref_o, ref_lse = merge_states_torch(o, lse)
    o = o.masked_fill(torch.isneginf(lse)[..., None], float("nan"))
    with force_triton(device == "cpu"):
        ko, klse = merge_states(o, lse)
    assert ko.dtype == dtype and klse.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(ko.float(), ref_o, rtol=tol, atol=tol)
    torch.testing.assert_close(klse, ref_lse, rtol=1e-6, atol=1e-5)
    assert torch.equal(ko[0, 0], torch.zeros_like(ko[0, 0])) and torch.isneginf(klse[0, 0])


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("B,S,H,D", [(1, 4, 3, 64), (1, 37, 5, 128), (2, 19, 4, 64),
                                     (1, 37, 5, 96), (2, 19, 3, 40)])  # head_dim tiles padded
def test_merge_into_kernel_matches_torch(B, S, H, D, device):
    """Rows not a multiple of the kernel's row tile, empty accumulator rows and parts, and an
    LSE that is a strided view (heads outermost in memory)."""
    o_acc, lse_acc = _states(B, S, H, D, torch.float32, device=device)
    o, lse = _states(B, S, H, D, torch.float16, device=device)
    lse = lse.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    ref_o, ref_lse = o_acc.cpu().clone(), lse_acc.cpu().clone()
    merge_into(ref_o, ref_lse, o.cpu(), lse.cpu())
    with force_triton(device == "cpu"):
        merge_into(o_acc, lse_acc, o, lse)
    torch.testing.assert_close(o_acc.cpu(), ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_acc.cpu(), ref_lse, rtol=1e-6, atol=1e-5)
    assert torch.equal(o_acc[:, 0, 0], torch.zeros_like(o_acc[:, 0, 0]))
    assert torch.isneginf(lse_acc[:, 0, 0]).all()


def _group_merge_worker(rank, world, o_all, lse_all):
    o, lse = merge_states_group(o_all[rank], lse_all[rank])
    ref_o, ref_lse = merge_states(o_all, lse_all)
    torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-6)


def test_merge_states_group_gloo():
    world = 3
    o_all, lse_all = _states(world, 2, 4, 16, torch.float32)
    run_distributed(_group_merge_worker, world, o_all, lse_all)


def _group_edge_worker(rank, world):
    # empty states: nothing to send, the empty state back (it used to fail viewing the bytes)
    o, lse = merge_states_group(torch.zeros(0, 4, 16), torch.zeros(0, 4))
    assert o.shape == (0, 4, 16) and lse.shape == (0, 4)
    # +inf in one rank's lse: every rank raises (as merge_states does), none is left waiting
    lse = torch.zeros(2, 4)
    if rank == 1:
        lse[1, 2] = float("inf")
    with pytest.raises(ValueError, match="lse"):
        merge_states_group(torch.randn(2, 4, 16), lse)


def test_merge_states_group_edges_gloo():
    run_distributed(_group_edge_worker, 2)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_non_tensors_raise_value_error_on_the_kernel_path(device):
    """None where a tensor belongs: the ValueError naming it (not an AttributeError on the way
    to the kernel), for merge_states and merge_into."""
    o, lse = torch.randn(2, 3, 4, 16, device=device), torch.randn(2, 3, 4, device=device)
    acc_o, acc_l = o[0].clone(), lse[0].clone()
    with force_triton(device == "cpu"):
        with pytest.raises(ValueError, match="lse must be a torch.Tensor"):
            merge_states(o, None)
        with pytest.raises(ValueError, match="lse_acc must be a torch.Tensor"):
            merge_into(acc_o, None, o[1], lse[1])
        with pytest.raises(ValueError, match="lse must be a torch.Tensor"):
            merge_into(acc_o, acc_l, o[1], None)


def test_merge_matches_closed_form():
    # Two single-key parts: the merged LSE is log(e^a + e^b), O the softmax-weighted average.
    a, b = 0.3, -1.2
    o = torch.tensor([[[[1.0, 0.0]]], [[[0.0, 1.0]]]], dtype=F64)
    lse = torch.tensor([[[a]], [[b]]], dtype=F64)
    mo, mlse = merge_states(o, lse)
    wa = math.exp(a) / (math.exp(a) + math.exp(b))
    assert abs(mlse.item() - math.log(math.exp(a) + math.exp(b))) < 1e-15
    torch.testing.assert_close(mo[0, 0], torch.tensor([wa, 1 - wa], dtype=F64), rtol=0, atol=1e-15)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_float64_states_merge_in_float64_on_every_backend(device):
    """The docstring's promise: float64 inputs give float64 math and a float64 LSE, also where
    the kernels would run (they compute in float32), for merge_states and merge_into."""
    o = torch.randn(3, 2, 4, 16, dtype=torch.float64, device=device)
    lse = torch.randn(3, 2, 4, dtype=torch.float64, device=device) * 30
    want = merge_states_torch(o, lse)
    with force_triton(device == "cpu"):
        got = merge_states(o, lse)
        o_acc, lse_acc = o[0].clone(), lse[0].clone()
        merge_into(o_acc, lse_acc, o[1], lse[1])
    assert got[0].dtype == got[1].dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close((o_acc, lse_acc), merge_states_torch(o[:2], lse[:2]),
                               rtol=1e-14, atol=1e-14)
