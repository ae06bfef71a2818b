"""Public attention API: agrees with the reference, and bad input raises ValueError naming the argument."""

import pytest
import torch

import longctx
from longctx.reference import reference_attention


def test_attention_matches_reference_and_returns_lse():
    q = torch.randn(2, 9, 6, 32)
    k = torch.randn(2, 13, 2, 32)
    v = torch.randn(2, 13, 2, 32)
    o = longctx.attention(q, k, v, causal=True, q_start=4)
    o2, lse = longctx.attention(q, k, v, causal=True, q_start=4, return_lse=True)
    ro, rlse = reference_attention(q.double(), k.double(), v.double(), causal=True, q_start=4)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (2, 6, 9)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(o, ro.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o2, o)
    torch.testing.assert_close(lse, rlse.float(), rtol=1e-5, atol=1e-5)


def _qkv(Sq=4, Sk=5, Hq=4, Hkv=2, D=32, dtype=torch.float32):
    return (torch.randn(2, Sq, Hq, D, dtype=dtype), torch.randn(2, Sk, Hkv, D, dtype=dtype),
            torch.randn(2, Sk, Hkv, D, dtype=dtype))


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v: (q[0], k, v), "q must be"),
    (lambda q, k, v: (q, k[..., :16], v[..., :16]), "head_dim"),
    (lambda q, k, v: (q, k.half(), v.half()), "k has dtype"),
    (lambda q, k, v: (q, k, v[:, :3]), "k .* and v .* must have the same shape"),
    (lambda q, k, v: (q, k[:1], v[:1]), "batch"),
    (lambda q, k, v: (q[:, :, :3], k, v), "multiple of"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), "q must be one of"),
    (lambda q, k, v: (q[..., :20], k[..., :20], v[..., :20]), r"head_dim\) must be a multiple"),
    (lambda q, k, v: (q, k.to("meta"), v.to("meta")), "k is on meta"),
])
def test_attention_rejects_bad_input(mutate, match):
    q, k, v = mutate(*_qkv())
    with pytest.raises(ValueError, match=match):
        longctx.attention(q, k, v)


def test_attention_rejects_bad_options():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="softmax_scale"):
        longctx.attention(q, k, v, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="q_start"):
        longctx.attention(q, k, v, causal=True, q_start=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="k_start"):
        longctx.attention(q, k, v, causal=True, k_start=1.5)


def test_attention_per_sequence_offsets():
    q, k, v = _qkv(Sq=3, Sk=6)
    qs = torch.tensor([5, 0])
    o, lse = longctx.attention(q, k, v, causal=True, q_start=qs, return_lse=True)
    for b in range(2):
        ob, lb = longctx.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], causal=True,
                                   q_start=int(qs[b]), return_lse=True)
        torch.testing.assert_close(o[b:b + 1], ob)
        torch.testing.assert_close(lse[b:b + 1], lb)


def test_varlen_reference_path_matches_padded():
    lens_q, lens_k = [3, 1, 6], [5, 1, 6]
    Hq, Hkv, D = 4, 2, 32
    q = torch.randn(sum(lens_q), Hq, D)
    k = torch.randn(sum(lens_k), Hkv, D)
    v = torch.randn(sum(lens_k), Hkv, D)
    cu_q = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 6, 12], dtype=torch.int32)
    qs = torch.tensor([2, 0, 0])
    o, lse = longctx.attention(q, k, v, causal=True, q_start=qs, cu_seqlens_q=cu_q,
                               cu_seqlens_k=cu_k, return_lse=True)
    assert o.shape == q.shape and lse.shape == (Hq, q.shape[0])
    for b in range(3):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ob, lb = longctx.attention(q[None, sq], k[None, sk], v[None, sk], causal=True,
                                   q_start=int(qs[b]), return_lse=True)
        torch.testing.assert_close(o[sq], ob[0])
        torch.testing.assert_close(lse[:, sq], lb[0])


def test_varlen_rejects_bad_cu_seqlens():
    q = torch.randn(10, 4, 32)
    k = torch.randn(12, 2, 32)
    good = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="together"):
        longctx.attention(q, k, k, cu_seqlens_q=good)
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0"):
        longctx.attention(q, k, k, cu_seqlens_q=good, cu_seqlens_k=good)
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32"):
        longctx.attention(q, k, k, cu_seqlens_q=good.long(), cu_seqlens_k=good)
    with pytest.raises(ValueError, match="sequences"):
        longctx.attention(q, k, k, cu_seqlens_q=good,
                          cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32))
    with pytest.raises(ValueError, match="varlen"):
        longctx.attention(q[None], k, k, cu_seqlens_q=good,
                          cu_seqlens_k=torch.tensor([0, 5, 12], dtype=torch.int32))
