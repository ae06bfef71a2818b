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
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (2, 9, 6)
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
    assert o.shape == q.shape and lse.shape == (q.shape[0], Hq)
    for b in range(3):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ob, lb = longctx.attention(q[None, sq], k[None, sk], v[None, sk], causal=True,
                                   q_start=int(qs[b]), return_lse=True)
        torch.testing.assert_close(o[sq], ob[0])
        torch.testing.assert_close(lse[sq], lb[0])


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


# --------------------------------------------------------------------------- #
# The contracts' edges: one LSE layout; options of the wrong type or value
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("Sq,Hq", [(4, 4), (3, 6)], ids=["Sq==Hq", "Sq!=Hq"])
def test_attention_lse_merges_as_returned(Sq, Hq):
    """attention's LSE is o's shape without head_dim, the layout merge_states / merge_into take:
    the states of two key ranges merge, untransposed, into attention over all keys (Sq == Hq
    included, where a layout mix-up would pass the shape checks)."""
    q = torch.randn(2, Sq, Hq, 32, dtype=torch.float64)
    k, v = torch.randn(2, 11, 2, 32, dtype=torch.float64), torch.randn(2, 11, 2, 32, dtype=torch.float64)
    parts = [longctx.attention(q, k[:, a:e], v[:, a:e], causal=True, q_start=8, k_start=a,
                               return_lse=True) for a, e in ((0, 5), (5, 11))]
    o_all, lse_all = longctx.attention(q, k, v, causal=True, q_start=8, return_lse=True)
    assert lse_all.shape == o_all.shape[:-1] == (2, Sq, Hq)
    o, lse = longctx.merge_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(o, o_all, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, lse_all, rtol=0, atol=1e-12)
    o_acc, lse_acc = parts[0][0].clone(), parts[0][1].clone()
    longctx.merge_into(o_acc, lse_acc, *parts[1])
    torch.testing.assert_close(lse_acc, lse_all, rtol=0, atol=1e-12)
    o_acc, lse_acc = torch.zeros_like(o_all), torch.full_like(lse_all, float("-inf"))
    for a, e in ((0, 5), (5, 11)):
        longctx.attention_merge_into(o_acc, lse_acc, q, k[:, a:e], v[:, a:e], causal=True,
                                     q_start=8, k_start=a)
    torch.testing.assert_close(o_acc, o_all, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse_acc, lse_all, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kw,match", [
    ({"causal": "no"}, r"causal must be True or False, got 'no'"),
    ({"causal": None}, r"causal must be True or False, got None"),
    ({"causal": 1}, r"causal must be True or False, got 1"),
    ({"return_lse": "yes"}, r"return_lse must be True or False, got 'yes'"),
    ({"return_lse": [True]}, r"return_lse must be True or False"),
])
def test_attention_rejects_options_of_the_wrong_type(kw, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        longctx.attention(q, k, v, **kw)
    if "causal" in kw:
        with pytest.raises(ValueError, match=match):
            longctx.attention_merge_into(torch.zeros_like(q), torch.zeros(q.shape[:-1]), q, k, v, **kw)


@pytest.mark.parametrize("args,match", [
    ((None, "k", "v"), r"q must be a torch.Tensor, got NoneType"),
    (([1.0], "k", "v"), r"q must be a torch.Tensor, got list"),
    (("q", None, "v"), r"k must be a torch.Tensor, got NoneType"),
    (("q", "k", [[0.0]]), r"v must be a torch.Tensor, got list"),
])
def test_attention_rejects_non_tensors(args, match):
    qkv = dict(zip("qkv", _qkv()))
    args = [qkv[a] if isinstance(a, str) else a for a in args]
    with pytest.raises(ValueError, match=match):
        longctx.attention(*args)


def test_varlen_max_seqlen_is_an_int_that_covers_every_sequence():
    q, k = torch.randn(10, 4, 32), torch.randn(12, 2, 32)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for bad, match in ((2.5, r"max_seqlen_q must be an int >= 0 or None, got 2.5"),
                       (-1, r"max_seqlen_q must be an int >= 0 or None, got -1"),
                       (True, r"max_seqlen_q must be an int >= 0 or None, got True"),
                       (5, r"max_seqlen_q \(5\) is less than the longest sequence in "
                           r"cu_seqlens_q \(6\)")):
        with pytest.raises(ValueError, match=match):
            longctx.attention(q, k, k, max_seqlen_q=bad, max_seqlen_k=7, **kw)
    with pytest.raises(ValueError, match=r"max_seqlen_k \(6\) is less than the longest sequence"):
        longctx.attention(q, k, k, max_seqlen_q=6, max_seqlen_k=6, **kw)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be a torch.Tensor, got list"):
        longctx.attention(q, k, k, cu_seqlens_q=[0, 4, 10], cu_seqlens_k=cu_k)
    o = longctx.attention(q, k, k, max_seqlen_q=6, max_seqlen_k=7, **kw)
    torch.testing.assert_close(o, longctx.attention(q, k, k, **kw), rtol=0, atol=0)


def _decode_inputs():
    return torch.randn(2, 4, 32), torch.randn(2, 16, 2, 32), torch.randn(2, 16, 2, 32)


@pytest.mark.parametrize("kw,match", [
    ({"num_splits": True}, r"num_splits must be an int >= 1 or None, got True"),
    ({"num_splits": 2.0}, r"num_splits must be an int >= 1 or None, got 2.0"),
    ({"num_splits": 0}, r"num_splits must be an int >= 1 or None, got 0"),
    ({"return_lse": "no"}, r"return_lse must be True or False, got 'no'"),
    ({"cache_seqlens": [16, 16]}, r"cache_seqlens must be a torch.Tensor, got list"),
    ({"block_table": [[0], [1]]}, r"block_table must be a torch.Tensor, got list"),
])
def test_decode_rejects_options_of_the_wrong_type(kw, match):
    with pytest.raises(ValueError, match=match):
        longctx.decode(*_decode_inputs(), **kw)


def test_decode_rejects_non_tensors():
    q, k, v = _decode_inputs()
    with pytest.raises(ValueError, match=r"q must be a torch.Tensor, got NoneType"):
        longctx.decode(None, k, v)
    with pytest.raises(ValueError, match=r"v_cache must be a torch.Tensor, got list"):
        longctx.decode(q, k, v.tolist())


def test_paged_decode_without_lengths_checks_every_page_of_the_capacity():
    """No cache_seqlens: every sequence is max_pages x page_size long, so every page id of the
    table is read, and one out of range raises (instead of being clamped onto another page)."""
    q = torch.randn(2, 4, 32)
    pages = torch.randn(5, 16, 2, 32)
    table = torch.tensor([[0, 1], [2, 5]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table holds page ids outside \[0, 5\).*full "
                                         r"capacity 32"):
        longctx.decode(q, pages, pages, block_table=table)
    table[1, 1] = 4
    full = torch.full((2,), 32, dtype=torch.int32)
    torch.testing.assert_close(longctx.decode(q, pages, pages, block_table=table),
                               longctx.decode(q, pages, pages, block_table=table, cache_seqlens=full))


def test_paged_decode_refuses_a_page_size_that_is_not_a_power_of_two_from_16():
    q = torch.randn(2, 4, 32)
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    for page in (24, 8):
        pages = torch.randn(2, page, 2, 32)
        with pytest.raises(ValueError, match=rf"paged k_cache: page_size \(dim 1\) must be a "
                                             rf"power of two >= 16, got {page}"):
            longctx.decode(q, pages, pages, block_table=table)


def test_merge_rejects_bad_check_and_non_tensors():
    o, lse = torch.randn(3, 2, 4, 8), torch.randn(3, 2, 4)
    for bad in ("yes", 1, []):
        with pytest.raises(ValueError, match=r"check must be True or False"):
            longctx.merge_states(o, lse, check=bad)
        with pytest.raises(ValueError, match=r"check must be True or False"):
            longctx.merge_into(o[0].clone(), lse[0].clone(), o[1], lse[1], check=bad)
    with pytest.raises(ValueError, match=r"o must be a torch.Tensor, got list"):
        longctx.merge_states([o[0], o[1]], lse)
    with pytest.raises(ValueError, match=r"lse must be a torch.Tensor, got NoneType"):
        longctx.merge_states(o, None)
    with pytest.raises(ValueError, match=r"o_acc must be a torch.Tensor, got NoneType"):
        longctx.merge_into(None, lse[0], o[1], lse[1])


def test_forcing_the_kernels_onto_cpu_tensors_needs_the_interpreter():
    """Outside the Triton interpreter a Triton kernel cannot read host memory: forcing it onto
    CPU tensors is refused before any launch (the main test process has no interpreter)."""
    from longctx.backend import force_triton, interpreter_active

    assert not interpreter_active()
    with pytest.raises(RuntimeError, match=r"force_triton\(\) .* only the Triton interpreter can "
                                           r"do: set TRITON_INTERPRET=1"):
        with force_triton():
            pass
    with force_triton(False):  # leaving the choice to the device is always allowed
        assert longctx.attention(*_qkv()).shape == (2, 4, 4, 32)


def test_keys_no_query_sees_never_reach_the_output():
    """The CPU path over a cache buffer whose tail was never written (NaN / inf there): causal,
    the keys past the last query's position are invisible to every row, so the result equals
    the call on the written part; likewise decode past cache_seqlens (contiguous and paged)."""
    q, k, v = _qkv(Sq=4, Sk=12)
    want = longctx.attention(q, k[:, :7], v[:, :7], causal=True, q_start=3, return_lse=True)
    for junk in (float("nan"), float("inf")):
        kb, vb = k.clone(), v.clone()
        kb[:, 7:], vb[:, 7:] = junk, junk
        got = longctx.attention(q, kb, vb, causal=True, q_start=3, return_lse=True)
        torch.testing.assert_close(got, want)  # finite, and the sums agree to rounding
    qd, (_, k, v) = q[:, 0], _qkv(Sk=64)
    lens = torch.tensor([37, 2], dtype=torch.int32)
    want = longctx.decode(qd, k, v, cache_seqlens=lens)
    kb, vb = k.clone(), v.clone()
    kb[0, 37:], vb[0, 37:], vb[1, 2:] = float("nan"), float("nan"), float("inf")
    torch.testing.assert_close(longctx.decode(qd, kb, vb, cache_seqlens=lens), want)
    pages = torch.stack([kb, vb]).reshape(2, 8, 16, 2, 32)  # page size 16: pages 0-3 and 4-7
    table = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    torch.testing.assert_close(
        longctx.decode(qd, pages[0], pages[1], cache_seqlens=lens, block_table=table), want)


def test_softmax_scale_is_not_a_flag():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"softmax_scale must be a positive finite number"):
        longctx.attention(q, k, v, softmax_scale=True)


@pytest.mark.parametrize("kw", [{"max_seqlen_q": 3}, {"max_seqlen_k": 5}])
def test_dense_attention_refuses_varlen_lengths(kw):
    """max_seqlen_* size a varlen call's grid; a dense call would silently ignore them."""
    with pytest.raises(ValueError, match=r"max_seqlen_q / max_seqlen_k are for varlen inputs"):
        longctx.attention(*_qkv(), **kw)


def test_accumulators_must_not_share_memory():
    """o_acc / lse_acc are written in place: an expand()ed view (every row the same memory) is
    refused, naming it, by merge_into and attention_merge_into."""
    q, k, v = _qkv()
    o, lse = longctx.attention(q, k, v, return_lse=True)
    shared_o = torch.zeros(1, *o.shape[1:]).expand(o.shape)
    shared_lse = torch.full((1, *lse.shape[1:]), float("-inf")).expand(lse.shape)
    for o_acc, lse_acc, name in ((shared_o, lse.clone(), "o_acc"),
                                 (o.clone(), shared_lse, "lse_acc")):
        with pytest.raises(ValueError, match=rf"{name} is written in place.*expand"):
            longctx.merge_into(o_acc, lse_acc, o, lse)
        with pytest.raises(ValueError, match=rf"{name} is written in place.*expand"):
            longctx.attention_merge_into(o_acc, lse_acc, q, k, v)


def test_attention_merge_into_checks_the_running_lse_as_merge_into_does():
    q, k, v = _qkv()
    for bad in (float("nan"), float("inf")):
        lse_acc = torch.full(q.shape[:-1], float("-inf"))
        lse_acc[1, 2, 3] = bad
        with pytest.raises(ValueError, match=r"lse_acc must be finite or -inf"):
            longctx.attention_merge_into(torch.zeros_like(q), lse_acc, q, k, v)


def test_fp8_caches_are_refused_where_no_scales_are_taken():
    from longctx.fp8 import quantize_kv

    q, k, v = _qkv()
    (k8, _), (v8, _) = quantize_kv(k), quantize_kv(v)
    with pytest.raises(ValueError, match=r"attention_merge_into takes k and v in q's dtype, not "
                                         r"an fp8 cache"):
        longctx.attention_merge_into(torch.zeros_like(q), torch.zeros(q.shape[:-1]), q, k8, v8)
    from longctx.parallel import ring_attention

    with pytest.raises(ValueError, match=r"ring_attention takes k and v in q's dtype"):
        ring_attention(q, k8, v8)


def test_merge_states_group_without_a_process_group_is_one_rank():
    import torch.distributed as dist

    assert not dist.is_initialized()
    o, lse = torch.randn(2, 4, 8), torch.randn(2, 4)
    got = longctx.merge_states_group(o, lse)
    assert got[0] is o and got[1] is lse
    lse[1, 2] = float("nan")  # checked on CPU, as merge_states checks
    with pytest.raises(ValueError, match=r"lse must be finite or -inf"):
        longctx.merge_states_group(o, lse)


def test_merge_refuses_an_empty_head_dim():
    with pytest.raises(ValueError, match=r"o's last dim \(head_dim\) must be at least 1"):
        longctx.merge_states(torch.zeros(2, 3, 4, 0), torch.zeros(2, 3, 4))
