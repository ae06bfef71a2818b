"""longctx.decode: the Triton Flash-Decoding kernel (interpreter on CPU) and the CPU reference
path against the float64 reference; paged caches; CUDA graphs (gpu); input validation."""

import pytest
import torch

import longctx
from longctx.backend import force_triton
from longctx.decode import gather_pages
from longctx.reference import reference_attention

F64 = torch.float64


def _cache(B, S, Hkv, D, dtype, device):
    return (torch.randn(B, S, Hkv, D, dtype=dtype, device=device),
            torch.randn(B, S, Hkv, D, dtype=dtype, device=device))


def _paginate(k, v, page, seqlens, extra_pages=3):
    """Contiguous [B, S, H, D] -> shuffled pages [num_pages, page, H, D] + block_table [B, S/page]."""
    B, S = k.shape[:2]
    n = B * (S // page)
    perm = torch.randperm(n + extra_pages, device=k.device)[:n]
    kp = torch.randn(n + extra_pages, page, *k.shape[2:], dtype=k.dtype, device=k.device)
    vp = torch.randn_like(kp)
    kp[perm] = k.reshape(n, page, *k.shape[2:])
    vp[perm] = v.reshape(n, page, *v.shape[2:])
    table = perm.view(B, S // page).to(torch.int32)
    # ids past each sequence's length are never read: fill them with garbage
    for b, L in enumerate(seqlens.tolist()):
        table[b, -(-L // page):] = -7
    return kp, vp, table


def _ref(q, k, v, seqlens):
    o, lse = reference_attention(q[:, None].to(F64), k.to(F64), v.to(F64), seqlens_k=seqlens,
                                 compute_dtype=F64)
    return o[:, 0], lse[:, 0]


def _plain_torch_error(q, k, v, seqlens, o_ref):
    """Error of a plain implementation in q's dtype (the bar the kernel must meet within 2x)."""
    o, _ = reference_attention(q[:, None], k, v, seqlens_k=seqlens, compute_dtype=q.dtype)
    return (o[:, 0].to(F64) - o_ref).abs().max().item()


CASES = [  # B, lengths, Hq, Hkv, D
    (1, [1], 8, 8, 64),
    (3, [0, 17, 1000], 3, 1, 64),
    (2, [1000, 1], 16, 2, 128),
    (2, [77, 0], 6, 2, 64),
]


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_decode_kernel_matches_reference(case, paged, num_splits, device):
    B, lengths, Hq, Hkv, D = case
    dtype = torch.float16
    S = 1024
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    q = torch.randn(B, Hq, D, dtype=dtype, device=device)
    k, v = _cache(B, S, Hkv, D, dtype, device)
    o_ref, lse_ref = _ref(q, k, v, seqlens)
    bar = _plain_torch_error(q, k, v, seqlens, o_ref)
    if paged:
        kc, vc, table = _paginate(k, v, 16 if num_splits != 3 else 32, seqlens)
    else:
        kc, vc, table = k, v, None
    with force_triton(device == "cpu"):
        o, lse = longctx.decode(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                num_splits=num_splits, return_lse=True)
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (B, Hq)
    assert lse.dtype == torch.float32
    err = (o.to(F64) - o_ref).abs().max().item()
    assert err <= 2 * bar + 1e-4, f"kernel error {err:.2e} vs plain fp16 {bar:.2e}"
    empty = seqlens == 0
    assert torch.isneginf(lse[empty]).all() and torch.equal(o[empty], torch.zeros_like(o[empty]))
    torch.testing.assert_close(lse[~empty].to(F64), lse_ref[~empty], rtol=0, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("D", [40, 96])
def test_decode_head_dim_not_power_of_two(D, device):
    """longctx.decode at a head_dim that is not a power of two (Phi-3's 96; 40), paged and
    contiguous, GQA group 5, an empty sequence: the kernel within 2x of plain fp16, and the CPU
    reference path."""
    B, S, Hq, Hkv, dtype = 2, 64, 10, 2, torch.float16
    seqlens = torch.tensor([37, 0], dtype=torch.int32, device=device)
    q = torch.randn(B, Hq, D, dtype=dtype, device=device)
    k, v = _cache(B, S, Hkv, D, dtype, device)
    o_ref, _ = _ref(q, k, v, seqlens)
    bar = _plain_torch_error(q, k, v, seqlens, o_ref)
    kc, vc, table = _paginate(k, v, 16, seqlens)
    for args in ((k, v, None), (kc, vc, table)):
        with force_triton(device == "cpu"):
            o = longctx.decode(q, *args[:2], cache_seqlens=seqlens, block_table=args[2])
        assert o.shape == q.shape and (o[1] == 0).all()
        err = (o.to(F64) - o_ref).abs().max().item()
        assert err <= 2 * bar + 1e-4, f"kernel error {err:.2e} vs plain fp16 {bar:.2e}"
    if device == "cpu":
        o = longctx.decode(q, kc, vc, cache_seqlens=seqlens, block_table=table)
        assert (o.to(F64) - o_ref).abs().max().item() <= bar + 1e-4


@pytest.mark.gpu
@pytest.mark.interpreter
def test_decode_fp32_and_4d_query(device):
    B, S, Hq, Hkv, D = 2, 300, 6, 2, 64
    q = torch.randn(B, 1, Hq, D, device=device)
    k, v = _cache(B, S, Hkv, D, torch.float32, device)
    seqlens = torch.tensor([300, 129], dtype=torch.int32, device=device)
    o_ref, _ = _ref(q[:, 0], k, v, seqlens)
    with force_triton(device == "cpu"):
        o = longctx.decode(q, k, v, cache_seqlens=seqlens)
    assert o.shape == q.shape
    # fp32 dots may run in tf32 on a GPU
    torch.testing.assert_close(o[:, 0].to(F64), o_ref, rtol=0, atol=2e-3 if q.is_cuda else 1e-5)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_decode_states_merge_as_they_are(device):
    """(o, lse) of decode over two halves of each cache go to merge_states / merge_into unchanged
    and give decode over the whole cache, for a [B, Hq, D] and a [B, 1, Hq, D] q (lse shaped
    like o without head_dim): the kernel (interpreter on CPU)."""
    _check_states_merge(device, kernel=True)


def test_decode_states_merge_as_they_are_reference_path():
    """The same on the CPU reference path."""
    _check_states_merge("cpu", kernel=False)


def _check_states_merge(device, kernel):
    B, S, Hq, Hkv, D = 2, 96, 6, 2, 32
    k, v = _cache(B, S, Hkv, D, torch.float32, device)
    seqlens = torch.tensor([96, 40], dtype=torch.int32, device=device)
    half = torch.tensor([48, 40], dtype=torch.int32, device=device)  # keys in [0, 48)
    for q in (torch.randn(B, Hq, D, device=device), torch.randn(B, 1, Hq, D, device=device)):
        with force_triton(kernel and device == "cpu"):
            o, lse = longctx.decode(q, k, v, cache_seqlens=seqlens, return_lse=True)
            o1, l1 = longctx.decode(q, k[:, :48], v[:, :48], cache_seqlens=half, return_lse=True)
            o2, l2 = longctx.decode(q, k[:, 48:], v[:, 48:], cache_seqlens=seqlens - half,
                                    return_lse=True)
        assert o.shape == q.shape and lse.shape == q.shape[:-1] == l1.shape
        assert torch.isneginf(l2[1]).all()  # the second sequence has no key in the second half
        om, lm = longctx.merge_states(torch.stack([o1, o2]), torch.stack([l1, l2]))
        acc_o, acc_l = o1.float().clone(), l1.clone()
        longctx.merge_into(acc_o, acc_l, o2, l2)
        tol = dict(rtol=0, atol=2e-3 if q.is_cuda else 1e-5)  # tf32 dots on a GPU
        for got_o, got_l in ((om, lm), (acc_o, acc_l)):
            torch.testing.assert_close(got_o.float(), o.float(), **tol)
            torch.testing.assert_close(got_l, lse, **tol)


def test_decode_reference_path_paged_equals_contiguous():
    B, S, Hq, Hkv, D = 2, 64, 4, 2, 32
    q = torch.randn(B, Hq, D)
    k, v = _cache(B, S, Hkv, D, torch.float32, "cpu")
    seqlens = torch.tensor([64, 20], dtype=torch.int32)
    kc, vc, table = _paginate(k, v, 16, seqlens)
    o1, l1 = longctx.decode(q, k, v, cache_seqlens=seqlens, return_lse=True)
    o2, l2 = longctx.decode(q, kc, vc, cache_seqlens=seqlens, block_table=table, return_lse=True)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(l1, l2)
    o_ref, lse_ref = _ref(q, k, v, seqlens)
    torch.testing.assert_close(o1.to(F64), o_ref, rtol=0, atol=1e-5)
    assert torch.equal(gather_pages(kc, table)[0], k[0])


def _args():
    q = torch.randn(2, 4, 64)
    k = torch.randn(2, 32, 2, 64)
    return q, k, k.clone()


@pytest.mark.parametrize("mutate,kw,match", [
    (lambda q, k, v: (q[:, None].expand(2, 2, 4, 64), k, v), {}, "q must be"),
    (lambda q, k, v: (q[:1], k, v), {}, "k_cache has batch"),
    (lambda q, k, v: (q, k, v[:, :16]), {}, "k_cache and v_cache"),
    (lambda q, k, v: (q, k.half(), v.half()), {}, "k_cache has dtype"),
    (lambda q, k, v: (q[:, :3], k, v), {}, "multiple of"),
    (lambda q, k, v: (q[..., :44], k[..., :44], v[..., :44]), {}, r"head_dim\) must be a multiple"),
    (lambda q, k, v: (q[..., :8], k[..., :8], v[..., :8]), {}, r"multiple of 8 in \[16, 256\]"),
    (lambda q, k, v: (q, k, v), {"cache_seqlens": torch.tensor([1, 2])}, "cache_seqlens must be an int32"),
    (lambda q, k, v: (q, k, v), {"cache_seqlens": torch.tensor([1, 33], dtype=torch.int32)},
     r"cache_seqlens\[1\] = 33 is outside"),
    (lambda q, k, v: (q, k, v), {"num_splits": 0}, "num_splits"),
    (lambda q, k, v: (q, k, v), {"softmax_scale": float("nan")}, "softmax_scale"),
    (lambda q, k, v: (q, k, v), {"block_table": torch.zeros(2, 2)}, "block_table must be an int32"),
    (lambda q, k, v: (q, k[:, :24], v[:, :24]), {"block_table": torch.zeros(2, 2, dtype=torch.int32)},
     "page_size"),
    (lambda q, k, v: (q, k, v),
     {"block_table": torch.tensor([[0, 1], [1, 2]], dtype=torch.int32),
      "cache_seqlens": torch.tensor([64, 64], dtype=torch.int32)}, "block_table holds page ids"),
])
def test_decode_rejects_bad_input(mutate, kw, match):
    q, k, v = mutate(*_args())
    with pytest.raises(ValueError, match=match):
        longctx.decode(q, k, v, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128, 256, 96, 192])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_gpu_error_within_2x_of_torch(dtype, D, paged):
    B, S, Hq, Hkv = 4, 8192, 24, 8  # group 3
    seqlens = torch.tensor([8192, 1, 4097, 0], dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, D, dtype=dtype, device="cuda")
    k, v = _cache(B, S, Hkv, D, dtype, "cuda")
    o_ref, lse_ref = reference_attention(q[:, None].float(), k.float(), v.float(), seqlens_k=seqlens)
    o_ref = o_ref[:, 0].to(F64)
    bar = _plain_torch_error(q, k, v, seqlens, o_ref)
    kc, vc, table = _paginate(k, v, 64, seqlens) if paged else (k, v, None)
    o, lse = longctx.decode(q, kc, vc, cache_seqlens=seqlens, block_table=table, return_lse=True)
    err = (o.to(F64) - o_ref).abs().max().item()
    assert err <= 2 * bar + 1e-6, f"kernel {err:.2e} vs plain torch {bar:.2e}"
    torch.testing.assert_close(lse[seqlens > 0], lse_ref[:, 0][seqlens > 0], rtol=0, atol=1e-3)


@pytest.mark.gpu
def test_decode_cuda_graph_replays_with_growing_lengths():
    B, S, Hq, Hkv, D = 3, 4096, 16, 2, 128
    q = torch.randn(B, Hq, D, dtype=torch.float16, device="cuda")
    k, v = _cache(B, S, Hkv, D, torch.float16, "cuda")
    seqlens = torch.tensor([1, 100, 2000], dtype=torch.int32, device="cuda")
    longctx.decode(q, k, v, cache_seqlens=seqlens)  # compile outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        longctx.decode(q, k, v, cache_seqlens=seqlens)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = longctx.decode(q, k, v, cache_seqlens=seqlens)
    for step in range(4):
        seqlens.copy_(torch.tensor([1 + 900 * step, 100 + 1000 * step, 2000 + 500 * step]))
        q.copy_(torch.randn_like(q))
        g.replay()
        o_ref, _ = _ref(q.float().cpu(), k.float().cpu(), v.float().cpu(), seqlens.cpu())
        torch.testing.assert_close(out.cpu().to(F64), o_ref, rtol=0, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("paged", [False, True])
def test_decode_kernel_never_reads_past_the_lengths(paged, device):
    """Cache slots past each sequence's length hold NaN / inf (an unwritten torch.empty cache):
    the kernel's result equals the one over a clean cache, ragged ends and an empty row."""
    B, S, Hq, Hkv, D = 3, 256, 6, 2, 64
    seqlens = torch.tensor([131, 0, 200], dtype=torch.int32, device=device)
    q = torch.randn(B, Hq, D, dtype=torch.float16, device=device)
    k, v = _cache(B, S, Hkv, D, torch.float16, device)
    kj, vj = k.clone(), v.clone()
    for b, L in enumerate(seqlens.tolist()):
        kj[b, L:], vj[b, L:] = float("nan"), float("inf") if b else float("nan")
    with force_triton(device == "cpu"):
        if paged:
            table = torch.arange(B * S // 16, dtype=torch.int32, device=device).view(B, -1)
            args = [(x.reshape(-1, 16, Hkv, D), y.reshape(-1, 16, Hkv, D), table)
                    for x, y in ((k, v), (kj, vj))]
        else:
            args = [(k, v, None), (kj, vj, None)]
        want, got = (longctx.decode(q, x, y, cache_seqlens=seqlens, block_table=t, num_splits=4,
                                    return_lse=True) for x, y, t in args)
    assert torch.isfinite(got[0]).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
