"""The fast launch path on a GPU: the same bits as Triton's generic launch path for every public
entry point, the binary Triton itself would pick, a new plan for every changed stride / dtype /
shape / alignment, and CUDA-graph capture.

    python -m pytest -q tests/test_fast_launch_gpu.py
"""

import importlib

import pytest
import torch
from triton import knobs

import longctx
from longctx.kernels import launch as L
from longctx.kernels.utils import pdl_off

pytestmark = pytest.mark.gpu

api_attention = importlib.import_module("longctx.attention")
api_decode = importlib.import_module("longctx.decode")
api_merge = importlib.import_module("longctx.merge")
F64 = torch.float64


@pytest.fixture(autouse=True)
def _fresh_plans():
    for d in (api_decode._PLANS, api_attention._PLANS, api_attention._MERGE_PLANS,
              api_merge._STATES_PLANS, api_merge._INTO_PLANS):
        d.clear()


def _generic(fn, *args, **kw):
    with L.fast_launch(False):
        return fn(*args, **kw)


def _same(a, b):
    if isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), f"max diff {(a.to(F64) - b.to(F64)).abs().max().item()}"


def _plan(cache: dict, before: set):
    new = [p for k, p in cache.items() if k not in before]
    assert len(new) == 1
    return new[0]


def _assert_tritons_binary(launch: L.Launch, *dyn: torch.Tensor) -> None:
    """The binary the fast path launches for these (aligned) tensors is the one Triton's generic
    path compiles for them."""
    ck = launch.fn.run(*dyn, *launch.tail, grid=launch.grid, warmup=True, **launch.kwargs)
    code = L.spec_code(tuple(t if isinstance(t, int) else t.data_ptr() for t in dyn), launch.dyn_dtypes)
    assert launch._binaries[code].binary is ck


def _paged(k, v, page, lens):
    B, S = k.shape[:2]
    n = B * (S // page)
    perm = torch.randperm(n + 3, device=k.device)[:n]
    kp = torch.randn(n + 3, page, *k.shape[2:], dtype=k.dtype, device=k.device)
    vp = torch.randn_like(kp)
    kp[perm] = k.reshape(n, page, *k.shape[2:])
    vp[perm] = v.reshape(n, page, *v.shape[2:])
    table = perm.view(B, S // page).to(torch.int32)
    for b, length in enumerate(lens.tolist()):
        table[b, -(-length // page):] = -7  # never read
    return kp, vp, table


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("with_lens", [True, False])
@pytest.mark.parametrize("num_splits", [1, 8, None])
@pytest.mark.parametrize("q4d", [False, True])
def test_decode_fast_is_generic(dtype, paged, with_lens, num_splits, q4d):
    B, S, Hq, Hkv, D = 3, 4096, 24, 8, 128  # group 3
    q = torch.randn(B, 1, Hq, D, dtype=dtype, device="cuda")
    q = q if q4d else q[:, 0]
    k = torch.randn(B, S, Hkv, D, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    lens = torch.tensor([4096, 1, 1000], dtype=torch.int32, device="cuda")
    kw = dict(cache_seqlens=lens if with_lens else None, num_splits=num_splits, return_lse=True)
    if paged:
        k, v, kw["block_table"] = _paged(k, v, 64, lens if with_lens else torch.full_like(lens, S))
    before = set(api_decode._PLANS)
    o, lse = longctx.decode(q, k, v, **kw)
    _same((o, lse), _generic(longctx.decode, q, k, v, **kw))
    _same((o, lse), longctx.decode(q, k, v, **kw))  # the cached plan
    plan = _plan(api_decode._PLANS, before)
    kf, vf = ((api_decode.gather_pages(x, kw["block_table"]) if paged else x).float() for x in (k, v))
    ref_o, ref_lse = longctx.reference_attention(q.reshape(B, 1, Hq, D).float(), kf, vf,
                                                 seqlens_k=lens if with_lens else None)
    torch.testing.assert_close(o.reshape(B, Hq, D).float(), ref_o[:, 0], rtol=2e-2, atol=2e-2)
    assert lse.shape == q.shape[:-1]  # o without head_dim: [B, Hq] or [B, 1, Hq]
    torch.testing.assert_close(lse.reshape(B, Hq), ref_lse[:, 0], rtol=0, atol=1e-3)
    # The binaries launched are Triton's own picks for tensors of these dtypes and alignment.
    sl = lens if with_lens else q
    bt = kw.get("block_table", sl)
    one = plan.num_splits == 1
    o_part = torch.empty(plan.num_splits, B, Hq, D, device="cuda",
                         dtype=dtype if one else torch.float32)
    lse_part = torch.empty(plan.num_splits, B, Hq, device="cuda")
    fused = not one and plan.merge is None  # the split kernel merges (o, lse and counters used)
    counters = torch.zeros(max(plan.counters, 1), dtype=torch.int32, device="cuda")
    # (the last four: an fp8 cache's scales and smoothing means; any aligned float32 pointer
    # for this cache)
    _assert_tritons_binary(plan.split, q, k, v, sl, bt, o_part, lse_part,
                           o if fused or one else o_part, lse, counters, lse, lse, lse, lse)
    if plan.merge is not None:
        _assert_tritons_binary(plan.merge, o_part, lse_part, o, lse)


def test_decode_changed_signature_takes_the_right_kernel():
    """Between calls only one thing changes: the output is always the generic path's."""
    B, S, Hq, Hkv, D = 2, 2048, 16, 2, 128
    q = torch.randn(B, Hq, D, dtype=torch.float16, device="cuda")
    big = torch.randn(B, S, 2 * Hkv, D, dtype=torch.float16, device="cuda")
    k = big[:, :, :Hkv].contiguous()
    v = torch.randn_like(k)
    lens = torch.tensor([2048, 77], dtype=torch.int32, device="cuda")
    qbuf = torch.randn(B * Hq * D + 1, dtype=torch.float16, device="cuda")
    q_odd = qbuf[1:].view(B, Hq, D)  # same strides, pointer not 16-byte aligned
    calls = [(q, k, v, lens),
             (q, big[:, :, Hkv:], v, lens),                        # k's strides
             (q.bfloat16(), k.bfloat16(), v.bfloat16(), lens),     # dtype
             (q[:1], k[:1], v[:1], lens[:1]),                      # batch
             (q, k[:, :1000], v[:, :1000], lens.clamp(max=1000)),  # capacity
             (q_odd, k, v, lens),                                  # q's alignment
             (q, k, v, lens)]
    for qq, kk, vv, ll in calls * 2:  # twice: the second round hits the cache
        for splits in (None, 4):
            kw = dict(cache_seqlens=ll, num_splits=splits, return_lse=True)
            _same(longctx.decode(qq, kk, vv, **kw), _generic(longctx.decode, qq, kk, vv, **kw))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_decode_on_another_device():
    for dev in ("cuda:0", "cuda:1"):
        with torch.cuda.device(dev):
            q = torch.randn(2, 16, 128, dtype=torch.float16, device=dev)
            k = torch.randn(2, 4096, 2, 128, dtype=torch.float16, device=dev)
            _same(longctx.decode(q, k, k), _generic(longctx.decode, q, k, k))


def test_decode_pdl_switch_takes_its_own_plan():
    q = torch.randn(4, 16, 128, dtype=torch.float16, device="cuda")
    k = torch.randn(4, 4096, 2, 128, dtype=torch.float16, device="cuda")
    o = longctx.decode(q, k, k)
    with pdl_off():
        o_off = longctx.decode(q, k, k)
        plans = [p for p in api_decode._PLANS.values() if not p.split.kwargs["USE_PDL"]]
        assert plans
    _same(o, o_off)


def test_decode_cuda_graph_with_fast_launches():
    """Captured with the fast path, replayed as lengths and q change: the eager results."""
    B, S, Hq, Hkv, D = 3, 8192, 16, 2, 128
    q = torch.randn(B, Hq, D, dtype=torch.float16, device="cuda")
    k = torch.randn(B, S, Hkv, D, dtype=torch.float16, device="cuda")
    v = torch.randn_like(k)
    lens = torch.tensor([1, 100, 2000], dtype=torch.int32, device="cuda")
    longctx.decode(q, k, v, cache_seqlens=lens, return_lse=True)  # compile outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        longctx.decode(q, k, v, cache_seqlens=lens, return_lse=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, out_lse = longctx.decode(q, k, v, cache_seqlens=lens, return_lse=True)
    for step in range(4):
        lens.copy_(torch.tensor([1 + 2000 * step, 100 + 1000 * step, 2000 + 1500 * step]))
        q.copy_(torch.randn_like(q))
        g.replay()
        eager = longctx.decode(q, k, v, cache_seqlens=lens, return_lse=True)
        _same((out, out_lse), eager)
        _same(eager, _generic(longctx.decode, q, k, v, cache_seqlens=lens, return_lse=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", ["dense", "causal_int", "causal_tensor", "causal_2048", "short_q"])
def test_attention_fast_is_generic(dtype, case):
    B, Sq, Sk, Hq, Hkv, D = 2, 300, 517, 12, 4, 128
    kw = dict(return_lse=True)
    if case == "causal_int":
        kw.update(causal=True, q_start=217)
    elif case == "causal_tensor":
        kw.update(causal=True, q_start=torch.tensor([217, 5], device="cuda"),
                  k_start=torch.tensor([0, 3], dtype=torch.int32, device="cuda"))
    elif case == "causal_2048":  # on an H100/H200 bf16/fp16 this is the Gluon kernel's call
        B, Sq, Sk, Hq, Hkv = 1, 2048, 2048, 16, 2
        kw.update(causal=True)
    elif case == "short_q":
        Sq = 37
        kw.update(causal=True, q_start=Sk - Sq)
    q = torch.randn(B, Sq, Hq, D, dtype=dtype, device="cuda")
    k = torch.randn(B, Sk, Hkv, D, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    fast = longctx.attention(q, k, v, **kw)
    _same(fast, _generic(longctx.attention, q, k, v, **kw))
    _same(longctx.attention(q, k, v, **kw), fast)


def test_attention_varlen_fast_is_generic():
    lens_q, lens_k = [300, 0, 1, 129], [517, 3, 1, 129]
    Hq, Hkv, D = 8, 2, 64
    q = torch.randn(sum(lens_q), Hq, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(sum(lens_k), Hkv, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    kw = dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), max_seqlen_q=300, max_seqlen_k=517,
              causal=True, q_start=torch.tensor([217, 0, 0, 0], device="cuda"), return_lse=True)
    _same(longctx.attention(q, k, v, **kw), _generic(longctx.attention, q, k, v, **kw))


@pytest.mark.parametrize("rows", [256, 2048])
def test_attention_merge_into_fast_is_generic(rows):
    B, Hq, Hkv, D = 1, 16, 2, 128
    q = torch.randn(B, rows, Hq, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, rows, Hkv, D, dtype=torch.bfloat16, device="cuda")
    o0 = torch.randn(B, rows, Hq, D, device="cuda")
    lse0 = torch.randn(B, rows, Hq, device="cuda")
    lse0[:, : rows // 4] = float("-inf")  # empty rows of the running state
    states = []
    for fn in (longctx.attention_merge_into,
               lambda *a, **kw: _generic(longctx.attention_merge_into, *a, **kw)):
        o_acc, lse_acc = o0.clone(), lse0.clone()
        for step in range(3):
            fn(o_acc, lse_acc, q, k, k, causal=step == 0, k_start=step * rows)
        states.append((o_acc, lse_acc))
    _same(*states)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_merge_fast_is_generic(layout):
    P, B, H, D = 6, 3, 16, 128
    o = torch.randn(P, B, H, D, device="cuda", dtype=torch.bfloat16)
    lse = torch.randn(P, B, H, device="cuda")
    lse[2] = float("-inf")
    if layout == "strided":
        o = torch.randn(P, H, B, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        lse = torch.randn(P, H, B, device="cuda").transpose(1, 2)
    _same(longctx.merge_states(o, lse), _generic(longctx.merge_states, o, lse))
    accs = []
    for fn in (longctx.merge_into, lambda *a: _generic(longctx.merge_into, *a)):
        o_acc, lse_acc = torch.zeros(B, H, D, device="cuda"), torch.full((B, H), float("-inf"), device="cuda")
        for p in range(P):
            fn(o_acc, lse_acc, o[p], lse[p])
        accs.append((o_acc, lse_acc))
    _same(*accs)


def test_launch_hook_takes_the_generic_path():
    q = torch.randn(2, 16, 128, dtype=torch.float16, device="cuda")
    k = torch.randn(2, 4096, 2, 128, dtype=torch.float16, device="cuda")
    o = longctx.decode(q, k, k)
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        o_hooked = longctx.decode(q, k, k)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert any("decode" in name for name in seen), seen
    _same(o, o_hooked)


hopper_only = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 (Hopper) GPU")


@hopper_only
@pytest.mark.parametrize("case", ["causal", "dense_b2", "offsets", "varlen", "merge"])
def test_hopper_plan_fast_is_generic(case):
    """The Gluon kernel's cached launch (HopperLaunch) gives the generic path's bits, with and
    without the LSE, and a call made under LONGCTX_PREFILL_KERNEL=triton takes the Triton kernel
    from the same plan."""
    from longctx.kernels import prefill_hopper as PH

    g = torch.Generator(device="cuda").manual_seed(5)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    before = set(api_attention._PLANS)
    if case == "varlen":
        lens = [5000, 17, 0, 4200]  # causal varlen: the Gluon kernel from 2048 rows on average
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")
        q, k, v = mk(sum(lens), 16, 128), mk(sum(lens), 2, 128), mk(sum(lens), 2, 128)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5000, max_seqlen_k=5000,
                  causal=True)
    else:
        B, S = (2, 3000) if case == "dense_b2" else (1, 4225)
        q, k, v = mk(B, S, 16, 128), mk(B, S, 2, 128), mk(B, S, 2, 128)
        kw = dict(causal=case != "dense_b2")
        if case == "offsets":
            kw.update(q_start=torch.tensor([300], device="cuda"), k_start=7)
    if case == "merge":
        o0, l0 = torch.randn(1, 4225, 16, 128, device="cuda"), torch.randn(1, 4225, 16, device="cuda")
        states = []
        for fn in (longctx.attention_merge_into,
                   lambda *a, **k2: _generic(longctx.attention_merge_into, *a, **k2)):
            o_acc, lse_acc = o0.clone(), l0.clone()
            fn(o_acc, lse_acc, q, k, v, **kw)
            states.append((o_acc, lse_acc))
        _same(*states)
        return
    fast = longctx.attention(q, k, v, return_lse=True, **kw)
    plan = _plan(api_attention._PLANS, before)
    assert isinstance(plan.hopper, PH.HopperLaunch)
    _same(fast, _generic(longctx.attention, q, k, v, return_lse=True, **kw))
    _same(longctx.attention(q, k, v, **kw), fast[0])  # without the LSE (stream scratch)
    keys = set(api_attention._PLANS)
    from longctx.kernels.prefill import prefill_kernel

    with prefill_kernel("triton"):
        triton_run = longctx.attention(q, k, v, return_lse=True, **kw)
    assert set(api_attention._PLANS) == keys  # the same plan, its Triton launch
    torch.testing.assert_close(triton_run[0], fast[0], atol=2e-2, rtol=2e-2)


def test_stream_scratch_per_stream_and_fresh_in_capture():
    """One buffer per (stream, slot), reused; a capture gets its own allocation."""
    dev = torch.cuda.current_device()
    a = L.stream_scratch(1000, dev, "t")
    assert L.stream_scratch(500, dev, "t").data_ptr() == a.data_ptr()
    assert L.stream_scratch(500, dev, "u").data_ptr() != a.data_ptr()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert L.stream_scratch(500, dev, "t").data_ptr() != a.data_ptr()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            inside = L.stream_scratch(500, dev, "t")
        assert inside.data_ptr() != L.stream_scratch(500, dev, "t").data_ptr()


@pytest.mark.parametrize("rows", [512, 2048])  # the Triton kernel; on sm_90 the Gluon kernel
def test_attention_cuda_graph_with_fast_launches(rows):
    """Several attention calls without the LSE captured in one graph (the LSE and the TMA
    descriptors then live in allocations made during the capture) replay to the eager bits."""
    q = torch.randn(1, rows, 16, 128, dtype=torch.bfloat16, device="cuda")
    kv = [torch.randn(1, rows, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(6)]
    calls = lambda: [longctx.attention(q, kv[2 * i], kv[2 * i + 1], causal=True)  # noqa: E731
                     for i in range(3)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        calls()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = calls()
    q.copy_(torch.randn_like(q))
    g.replay()
    for o, want in zip(outs, calls(), strict=True):
        _same(o, want)
