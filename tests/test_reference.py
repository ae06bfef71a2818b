"""The reference attention against a naive per-row softmax(q k^T) v written out by hand."""

import math

import pytest
import torch

from longctx.reference import reference_attention

F64 = torch.float64


def naive_attention(q, k, v, causal, q_start, k_start, seqlens_k, scale):
    """Row by row, head by head; the mask rule spelled out with Python ints."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    o = torch.zeros(B, Sq, Hq, D, dtype=F64)
    lse = torch.full((B, Sq, Hq), float("-inf"), dtype=F64)
    for b in range(B):
        qs = int(q_start[b]) if isinstance(q_start, torch.Tensor) else q_start
        ks = int(k_start[b]) if isinstance(k_start, torch.Tensor) else k_start
        n = Sk if seqlens_k is None else int(seqlens_k[b])
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            for i in range(Sq):
                keys = [j for j in range(n) if not causal or ks + j <= qs + i]
                if not keys:
                    continue
                s = torch.stack([q[b, i, h] @ k[b, j, kh] * scale for j in keys])
                lse[b, i, h] = torch.logsumexp(s, 0)
                p = torch.softmax(s, 0)
                o[b, i, h] = sum(p[t] * v[b, j, kh] for t, j in enumerate(keys))
    return o, lse


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (3, 1), (6, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_naive(Hq, Hkv, causal):
    B, Sq, Sk, D = 2, 5, 7, 8
    q, k, v = (torch.randn(B, s, h, D, dtype=F64) for s, h in ((Sq, Hq), (Sk, Hkv), (Sk, Hkv)))
    q_start = torch.tensor([3, 0])  # sequence 1: the first query sees only key 0 ... or none
    k_start = torch.tensor([0, 2])
    seqlens_k = torch.tensor([7, 4])
    o, lse = reference_attention(q, k, v, causal=causal, q_start=q_start, k_start=k_start,
                                 seqlens_k=seqlens_k, compute_dtype=F64)
    no, nlse = naive_attention(q, k, v, causal, q_start, k_start, seqlens_k, D**-0.5)
    torch.testing.assert_close(o, no, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, nlse, rtol=0, atol=1e-12)
    if causal:  # batch 1: queries 0 and 1 (positions 0, 1) precede the first key (position 2)
        assert torch.isneginf(lse[1, :2]).all() and torch.equal(o[1, :2], torch.zeros_like(o[1, :2]))


def test_reference_scale_dtype_and_empty_keys():
    q = torch.randn(1, 3, 2, 16)
    k = torch.randn(1, 4, 2, 16)
    v = torch.randn(1, 4, 2, 16)
    o, lse = reference_attention(q, k, v, softmax_scale=0.5)
    o64, lse64 = reference_attention(q.double(), k.double(), v.double(), softmax_scale=0.5)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(o, o64.float(), rtol=1e-5, atol=1e-6)
    # A single key: softmax weight 1, LSE = the score itself.
    o1, lse1 = reference_attention(q.double(), k[:, :1].double(), v[:, :1].double())
    s = torch.einsum("bqhd,bkhd->bqhk", q.double(), k[:, :1].double())[..., 0] / math.sqrt(16)
    torch.testing.assert_close(lse1, s, rtol=0, atol=1e-12)
    torch.testing.assert_close(o1, v[:, :1].double().expand_as(o1), rtol=0, atol=1e-12)
    # No keys at all: the empty state.
    o0, lse0 = reference_attention(q, k[:, :0], v[:, :0])
    assert torch.equal(o0, torch.zeros_like(o0)) and torch.isneginf(lse0).all()
