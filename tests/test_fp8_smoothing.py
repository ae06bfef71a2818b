"""The fp8 cache's smoothing (longctx.fp8): K and V stored less a mean per (sequence, KV head,
channel), the attention adding the means back to its state. The rule on the CPU, the writers
bit for bit, the decode kernel and the prefill's correction against the float64 reference over
the dequantized values plus the means, the API's refusals, and the model taking its means from
each sequence's first prefill chunk (one process, tp=2 and sp=2)."""

from __future__ import annotations

import pytest
import torch

import longctx
from longctx.config import ModelArgs
from longctx.fp8 import (
    FP8, add_kv_means, dequantize_kv, key_major_v, kv_means, model_layout, quantize_kv,
)
from longctx.kernels.decode import flash_decode, flash_decode_partials
from longctx.merge import merge_states
from longctx.model import Transformer
from longctx.reference import reference_attention
from longctx.weights import RandomWeights, load_weights


def _offset_kv(shape, gen):
    """K and V [B, S, Hkv, D] float32 far from zero in some channels (K's outliers, as trained
    models' keys have), with their means [B, Hkv, D] over the positions."""
    B, S, H, D = shape
    k = torch.randn(shape, generator=gen) + 6 * torch.randn(B, 1, H, D, generator=gen) * (
        torch.rand(1, 1, 1, D, generator=gen) < 0.2)
    v = torch.randn(shape, generator=gen) + 2 * torch.randn(B, 1, H, D, generator=gen)
    return k, v, kv_means(k), kv_means(v)


# ---------------------------------------------------------------- the rule (torch, CPU) -------

def test_smoothing_rule():
    g = torch.Generator().manual_seed(0)
    k, _, km, _ = _offset_kv((2, 33, 3, 40), g)
    kq, ks = quantize_kv(k, km[:, None])
    kq0, ks0 = quantize_kv(k - km[:, None])
    assert torch.equal(kq.view(torch.uint8), kq0.view(torch.uint8)) and torch.equal(ks, ks0)
    back = dequantize_kv(kq, ks, torch.float32, km[:, None])
    # e4m3 on the smoothed rows: their error, not the raw rows', which the outliers set.
    err, err_plain = ((back - k).abs().max(), (dequantize_kv(*quantize_kv(k)) - k).abs().max())
    assert err <= (k - km[:, None]).abs().max() * 2**-4 and err < err_plain / 2, (err, err_plain)
    # One rounding to float32 (as a fused multiply-add): x * scale + mean exact, then rounded.
    exact = kq.double() * ks[..., None].double() + km[:, None].double()
    assert torch.equal(back, exact.float())
    torch.testing.assert_close(km, k.double().mean(1).float(), rtol=0, atol=0)
    assert torch.equal(kv_means(k[:, :0]), torch.zeros(2, 3, 40))


def test_add_kv_means_is_the_state_over_shifted_keys():
    """add_kv_means turns the state over (k, v) into the state over (k + k_mean, v + v_mean),
    GQA group 3, rows that see no key (causal, keys after them) left at O = 0, LSE = -inf."""
    g = torch.Generator().manual_seed(1)
    B, Sq, Sk, Hq, Hkv, D = 2, 7, 11, 6, 2, 16
    q = torch.randn(B, Sq, Hq, D, generator=g, dtype=torch.float64)
    k, v, km, vm = _offset_kv((B, Sk, Hkv, D), g)
    k, v = k.double(), v.double()
    kw = dict(causal=True, q_start=torch.tensor([3, 12]), k_start=5, softmax_scale=0.3)
    o, lse = reference_attention(q, k - km[:, None].double(), v - vm[:, None].double(), **kw)
    add_kv_means(o, lse, q, km, vm, 0.3)
    want, want_lse = reference_attention(q, k, v, **kw)
    empty = torch.isneginf(want_lse)
    assert empty[0].any() and not empty.all()
    torch.testing.assert_close(o, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    assert (o[empty] == 0).all()


@pytest.mark.gpu
@pytest.mark.interpreter
def test_add_kv_means_kernel_matches_the_rule(device):
    """kernels/fused.py add_kv_means (what longctx.attention runs on CUDA) against the torch rule:
    the output bit for bit (one rounding from the same float32 sum), the LSE to a float32
    rounding (its dot product summed in another order); q a strided view (a fused projection's
    heads), head_dim 48, GQA group 3, empty rows and a NaN row kept as they are."""
    from longctx.kernels.fused import add_kv_means as kernel

    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    g = torch.Generator().manual_seed(8)
    B, S, Hq, Hkv, D = 2, 37, 6, 2, 48
    qkv = torch.randn(B, S, Hq + 2 * Hkv, D, generator=g).to(dtype)
    q = qkv[:, :, :Hq]
    o = torch.randn(B, S, Hq, D, generator=g).to(dtype)
    lse = torch.randn(B, S, Hq, generator=g)
    lse[0, :5] = float("-inf")
    o[0, :5] = 0
    lse[1, 3, 2] = float("nan")
    km, vm = (torch.randn(B, Hkv, D, generator=g) * 3 for _ in range(2))
    want_o, want_lse = o.clone(), lse.clone()
    add_kv_means(want_o, want_lse, q, km, vm, 0.2)
    got_o, got_lse, q_d = o.to(device), lse.to(device), qkv.to(device)[:, :, :Hq]
    kernel(got_o, got_lse, q_d, km.to(device), vm.to(device), 0.2)
    assert torch.equal(got_o.cpu().view(torch.int16), want_o.view(torch.int16))
    torch.testing.assert_close(got_lse.cpu(), want_lse, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert (got_o.cpu()[0, :5] == 0).all() and torch.isneginf(got_lse.cpu()[0, :5]).all()


# ------------------------------------------------------- decode kernel (interpreter / GPU) ----

def _smoothed_case(B, S, Hq, Hkv, D, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    k, v, km, vm = _offset_kv((B, S, Hkv, D), g)
    (kq, ks), (vq, vs) = quantize_kv(k, km[:, None]), quantize_kv(v, vm[:, None])
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    k64 = dequantize_kv(kq, ks, torch.float64, km[:, None])
    v64 = dequantize_kv(vq, vs, torch.float64, vm[:, None])
    return q, (kq, vq, ks, vs), (km, vm), (k64, v64)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["usual", "model", "paged"])
@pytest.mark.parametrize("B,S,Hq,Hkv,D,lens,splits", [
    (3, 97, 6, 2, 32, [97, 0, 1], 3),      # GQA group 3, lengths 0 and 1; fused merge
    (2, 40, 4, 4, 48, [40, 17], 8),        # MHA, head_dim 48, more splits than blocks; separate
])
def test_decode_kernel_adds_the_means(device, layout, B, S, Hq, Hkv, D, lens, splits):
    """The split kernel over a smoothed fp8 cache (the usual layout, the model's: K and scales
    head-major, V key-major, and pages of 16) against the float64 reference over the
    dequantized values plus the means, within twice a plain computation's error; each split's
    partial state is exact on its own (merged by the merge layer, the same result); an empty
    sequence stays O = 0, LSE = -inf. Leaving out either mean moves the output or the LSE by
    far more than the tolerance (the means are several times the values' spread)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    q, cache, (km, vm), (k64, v64) = _smoothed_case(B, S, Hq, Hkv, D, dtype, device, seed=2)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    bt = None
    if layout == "model":
        cache = model_layout(*cache)
    elif layout == "paged":
        page, per_seq = 16, -(-S // 16)
        bt = torch.randperm(B * per_seq, generator=torch.Generator().manual_seed(3)).view(
            B, per_seq).to(torch.int32)
        pad = per_seq * page - S

        def pages(x):
            raw = x.view(torch.uint8) if x.dtype == FP8 else x
            raw = torch.cat([raw, torch.zeros_like(raw[:, :1]).expand(B, pad, *raw.shape[2:])], 1)
            out = torch.empty((B * per_seq, page, *raw.shape[2:]), dtype=raw.dtype)
            out[bt.long()] = raw.reshape(B, per_seq, page, *raw.shape[2:])
            return out.view(FP8) if x.dtype == FP8 else out

        cache = tuple(pages(t) for t in cache)
        bt = bt.to(device)
    kc, vc, ks, vs = (t.to(device) for t in cache)
    km_d, vm_d = km.to(device), vm.to(device)
    scale = D**-0.5
    q_d, sl = q.to(device), lens_t.to(device)
    o, lse = flash_decode(q_d, kc, vc, sl, bt, scale, splits, k_scale=ks, v_scale=vs,
                          k_mean=km_d, v_mean=vm_d)
    want, want_lse = reference_attention(q[:, None].double(), k64, v64, softmax_scale=scale,
                                         seqlens_k=lens_t)
    plain, _ = reference_attention(q[:, None], k64.to(dtype), v64.to(dtype), softmax_scale=scale,
                                   seqlens_k=lens_t, compute_dtype=dtype)
    want, want_lse, plain = want[:, 0], want_lse[:, 0], plain[:, 0]
    err = (o.double().cpu() - want).abs().max()
    err_plain = (plain.double() - want).abs().max()
    assert err <= 2 * err_plain + 1e-6, (err, err_plain)
    empty = lens_t == 0
    assert (o.cpu()[empty] == 0).all() and torch.isneginf(lse.cpu()[empty]).all()
    torch.testing.assert_close(lse.cpu()[~empty].double(), want_lse[~empty], rtol=0, atol=2e-3)
    # The means matter here: without them the answer is far off.
    o0, lse0 = flash_decode(q_d, kc, vc, sl, bt, scale, splits, k_scale=ks, v_scale=vs)
    assert (o0.double().cpu() - want).abs().max() > 20 * err_plain
    assert (lse0.cpu()[~empty].double() - want_lse[~empty]).abs().max() > 0.1
    # Each split's state is exact: the merge layer gives the same answer from the partials.
    o_part, lse_part = flash_decode_partials(q_d, kc, vc, sl, bt, scale, splits, k_scale=ks,
                                             v_scale=vs, k_mean=km_d, v_mean=vm_d)
    o_m, lse_m = merge_states(o_part, lse_part)
    torch.testing.assert_close(o_m.to(o.dtype), o, rtol=0, atol=2 * err_plain.item() + 1e-6)
    torch.testing.assert_close(lse_m, lse, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_prefill_over_a_smoothed_history(device):
    """longctx.attention over a smoothed fp8 history (a chunk's queries at its end, causal):
    the kernel's state plus the means, against the float64 reference; return_lse too."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    g = torch.Generator().manual_seed(4)
    B, S, Sq, Hq, Hkv, D = 2, 90, 37, 6, 2, 32
    k, v, km, vm = _offset_kv((B, S, Hkv, D), g)
    (kq, ks), (vq, vs) = quantize_kv(k, km[:, None]), quantize_kv(v, vm[:, None])
    k64 = dequantize_kv(kq, ks, torch.float64, km[:, None])
    v64 = dequantize_kv(vq, vs, torch.float64, vm[:, None])
    q = torch.randn(B, Sq, Hq, D, generator=g).to(dtype)
    kw = dict(causal=True, q_start=S - Sq)
    dev = [t.to(device) for t in (q, kq, vq, ks, vs, km, vm)]
    o, lse = longctx.attention(dev[0], dev[1], dev[2], k_scale=dev[3], v_scale=dev[4],
                               k_mean=dev[5], v_mean=dev[6], return_lse=True, **kw)
    o_only = longctx.attention(dev[0], dev[1], dev[2], k_scale=dev[3], v_scale=dev[4],
                               k_mean=dev[5], v_mean=dev[6], **kw)
    assert torch.equal(o_only, o)
    want, want_lse = reference_attention(q.double(), k64, v64, **kw)
    plain, _ = reference_attention(q, k64.to(dtype), v64.to(dtype), compute_dtype=dtype, **kw)
    err = (o.cpu().double() - want).abs().max()
    assert err <= 2 * (plain.double() - want).abs().max() + 1e-6
    torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=0, atol=2e-3)


# --------------------------------------------------------------- writers ----------------------

@pytest.mark.gpu
def test_writers_subtract_the_means_bit_for_bit():
    """store_fp8 (a prefill chunk; the usual layout and a key-major V), rope_store_kv (a decode
    step; the model's layout) and dequantize_fp8 follow quantize_kv / dequantize_kv with the
    means exactly."""
    from longctx import ops
    from longctx.kernels import fused

    g = torch.Generator().manual_seed(5)
    B, S, Hq, Hkv, D = 2, 40, 8, 2, 128
    x, _, m, _ = _offset_kv((B, 20, Hkv, D), g)
    x = x.to(torch.bfloat16)
    m_d = m.cuda()
    want, want_s = quantize_kv(x, m[:, None])
    for dst in (torch.zeros(B, S, Hkv, D, dtype=FP8, device="cuda"),
                key_major_v((B, S, Hkv, D), "cuda")):
        sc = torch.zeros(B, S, Hkv, device="cuda")
        fused.store_fp8(dst[:, 7:27], sc[:, 7:27], x.cuda(), m_d)
        assert torch.equal(dst[:, 7:27].cpu().view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(sc[:, 7:27].cpu(), want_s)
        back = fused.dequantize_fp8(dst[:, 7:27], sc[:, 7:27],
                                    torch.empty(B, 20, Hkv, D, dtype=torch.bfloat16,
                                                device="cuda"), m_d)
        assert torch.equal(back.cpu().view(torch.uint8),
                           dequantize_kv(want, want_s, torch.bfloat16, m[:, None])
                           .view(torch.uint8))
    cos, sin = ops.rope_tables(S, D, 1e4, torch.device("cuda"))
    q = torch.randn(B, Hq, D, generator=g).to(torch.bfloat16).cuda()
    k = (torch.randn(B, Hkv, D, generator=g) * 4).to(torch.bfloat16).cuda()
    v = torch.randn(B, Hkv, D, generator=g).to(torch.bfloat16).cuda()
    km, vm = (torch.randn(B, Hkv, D, generator=g).cuda() for _ in range(2))
    pos = torch.tensor([3, 39], device="cuda")
    kc, vc, kss, vss = model_layout(*(torch.zeros(B, S, Hkv, D, dtype=FP8, device="cuda")
                                      for _ in range(2)),
                                    *(torch.zeros(B, S, Hkv, device="cuda") for _ in range(2)))
    k_rot = k.clone()
    ops.rope_(k_rot[:, None], cos, sin, pos[:, None])
    ops.rope_store_kv(q, k, v, cos, sin, pos, kc, vc, pos, kss, vss, km, vm)
    assert torch.equal(k, k_rot)  # rotated in place, as without means
    b = torch.arange(B, device="cuda")
    for cache, scale, x, mean in ((kc, kss, k, km), (vc, vss, v, vm)):
        want, want_s = quantize_kv(x.cpu(), mean.cpu())
        assert torch.equal(cache.view(torch.uint8)[b, pos].cpu(), want.view(torch.uint8))
        assert torch.equal(scale[b, pos].cpu(), want_s)


@pytest.mark.interpreter
def test_writers_with_means_in_the_interpreter():
    """The same writers through the interpreter on the CPU: values within e4m3's rounding of
    the rule (the interpreter's float32 division is numpy's), the means subtracted."""
    from longctx import ops

    g = torch.Generator().manual_seed(6)
    B, S, Hq, Hkv, D = 2, 24, 4, 2, 32
    x, _, m, _ = _offset_kv((B, 10, Hkv, D), g)
    x = x.half()
    for dst in (torch.zeros(B, S, Hkv, D, dtype=FP8), key_major_v((B, S, Hkv, D), "cpu")):
        sc = torch.zeros(B, S, Hkv)
        ops.store_fp8(dst[:, 3:13], sc[:, 3:13], x, m)
        back = ops.dequantize_kv(dst[:, 3:13], sc[:, 3:13], torch.float32, m)
        smooth = (x.float() - m[:, None]).abs().amax(-1, keepdim=True)
        assert ((back - x.float()).abs() <= smooth * 2**-4 + 1e-6).all()
    cos, sin = ops.rope_tables(S, D, 1e4, torch.device("cpu"))
    q = torch.randn(B, Hq, D, generator=g).half()
    k, v = (torch.randn(B, Hkv, D, generator=g).half() + 5 for _ in range(2))
    km, vm = (torch.full((B, Hkv, D), 5.0) for _ in range(2))
    kc, vc = (torch.zeros(B, S, Hkv, D, dtype=FP8) for _ in range(2))
    kss, vss = (torch.zeros(B, S, Hkv) for _ in range(2))
    pos = torch.tensor([0, 7])
    v0 = v.clone()
    ops.rope_store_kv(q, k, v, cos, sin, pos, kc, vc, pos, kss, vss, km, vm)
    b = torch.arange(B)
    for cache, scale, x, mean in ((kc, kss, k, km), (vc, vss, v0, vm)):
        back = dequantize_kv(cache[b, pos], scale[b, pos], torch.float32, mean)
        assert ((back - x.float()).abs() <= (x.float() - mean).abs().amax(-1, keepdim=True)
                * 2**-4 + 1e-6).all()


# ----------------------------------------------------------------- API checks (CPU) ---------

def _api_case():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 16, generator=g)
    k, v, km, vm = _offset_kv((2, 8, 2, 16), g)
    (kq, ks), (vq, vs) = quantize_kv(k, km[:, None]), quantize_kv(v, vm[:, None])
    return q, kq, vq, ks, vs, km, vm


def test_decode_api_with_means_on_cpu_is_the_reference():
    q, kq, vq, ks, vs, km, vm = _api_case()
    lens = torch.tensor([8, 3], dtype=torch.int32)
    o, lse = longctx.decode(q, kq, vq, k_scale=ks, v_scale=vs, k_mean=km, v_mean=vm,
                            cache_seqlens=lens, return_lse=True)
    want, want_lse = reference_attention(q[:, None], dequantize_kv(kq, ks, torch.float32,
                                                                   km[:, None]),
                                         dequantize_kv(vq, vs, torch.float32, vm[:, None]),
                                         seqlens_k=lens)
    torch.testing.assert_close(o, want[:, 0])
    torch.testing.assert_close(lse, want_lse[:, 0])


@pytest.mark.parametrize("change,match", [
    (dict(v_mean=None), "k_mean and v_mean come together; v_mean is None"),
    (dict(k_mean="half"), "k_mean must be float32"),
    (dict(v_mean="shape"), r"v_mean must be \[B, Hkv, D\] = \[2, 2, 16\]"),
    (dict(k_mean="strided"), "k_mean must be contiguous"),
    (dict(k_mean=[0.0]), "k_mean must be a torch.Tensor"),
])
def test_decode_and_attention_refuse_bad_means(change, match):
    q, kq, vq, ks, vs, km, vm = _api_case()
    args = dict(k_mean=km, v_mean=vm)
    for name, how in change.items():
        base = args[name]
        args[name] = {"half": lambda: base.half(), "shape": lambda: base[:, :1],
                      "strided": lambda: base.transpose(1, 2).contiguous().transpose(1, 2)
                      }[how]() if isinstance(how, str) else how
    with pytest.raises(ValueError, match=match):
        longctx.decode(q, kq, vq, k_scale=ks, v_scale=vs, **args)
    with pytest.raises(ValueError, match=match):
        longctx.attention(q[:, None], kq, vq, k_scale=ks, v_scale=vs, **args)


def test_means_refused_without_an_fp8_cache():
    q, kq, vq, ks, vs, km, vm = _api_case()
    k = torch.randn(2, 8, 2, 16)
    with pytest.raises(ValueError, match="k_mean / v_mean are for an fp8"):
        longctx.decode(q, k, k, k_mean=km, v_mean=vm)
    with pytest.raises(ValueError, match="k_mean / v_mean are for an fp8"):
        longctx.attention(q[:, None], k, k, k_mean=km, v_mean=vm)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="for dense inputs, not varlen"):
        longctx.attention(q, k[0], k[0], cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32),
                          cu_seqlens_k=cu, k_mean=km, v_mean=vm)


# ------------------------------------------------------------------- the model (CPU) --------

def _tiny_model():
    args = ModelArgs(name="t", n_layers=2, dim=64, n_heads=6, n_kv_heads=2, head_dim=16,
                     intermediate_size=96, vocab_size=128)
    m = Transformer(args)
    load_weights(m, RandomWeights(0), {})
    return m


def test_model_takes_the_first_chunks_means():
    """A smoothed fp8 cache (the default) takes each sequence's means over its first prefill
    chunk's rotated keys and values, keeps them through later chunks and decode steps, and
    stores K and V less them; the logits stay close to the float32 cache's, as plain fp8's do.
    kv_smoothing=False gives plain fp8 (no means); fill_random_cache zeros them."""
    from longctx import ops

    m = _tiny_model()
    tok = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(5))
    out = {}
    for kvd, smooth in ((None, True), (FP8, True), (FP8, False)):
        m.setup_caches(2, 32, kvd, kv_smoothing=smooth)
        cache = m.layers[1].self_attn.kv_cache
        seen = []
        store = cache.store
        cache.store = lambda start, k, v: (seen.append((start, k.clone(), v.clone())),
                                           store(start, k, v))[1]
        with torch.no_grad():
            ls = [m.prefill(tok, torch.arange(23), chunk=8)]
            for p in range(23, 27):
                ls.append(m.decode_step(tok[:, p - 23], torch.full((2,), p)))
        out[kvd, smooth] = torch.stack(ls)
        if kvd is None:
            assert cache.k_mean is None
            continue
        if not smooth:
            assert cache.k_mean is None and cache.v_mean is None
            continue
        start, k0, v0 = seen[0]
        assert start == 0 and [s for s, *_ in seen] == [0, 8, 16]
        assert torch.equal(cache.k_mean, kv_means(k0)) and torch.equal(cache.v_mean, kv_means(v0))
        assert cache.k_mean.abs().max() > 0
        # A later chunk is stored less the first chunk's means.
        _, k1, v1 = seen[1]
        want, want_s = quantize_kv(k1, cache.k_mean[:, None])
        assert torch.equal(cache.k_cache[:, 8:16].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(cache.k_scale[:, 8:16], want_s)
        back = ops.dequantize_kv(cache.v_cache[:, :8], cache.v_scale[:, :8], torch.float32,
                                 cache.v_mean)
        assert (back - v0).abs().max() < 0.1 * v0.abs().max()
    ref = out[None, True]
    for smooth in (True, False):
        err = (out[FP8, smooth] - ref).abs().max()
        assert 0 < err < 0.05 * ref.abs().max(), (smooth, err)
    m.setup_caches(1, 40, FP8)
    cache = m.layers[0].self_attn.kv_cache
    cache.k_mean.fill_(1.0)
    m.fill_random_cache(30, seed=1)
    assert cache.k_mean.count_nonzero() == 0 and cache.v_mean.count_nonzero() == 0

