"""The fp8 (e4m3) KV cache: the quantization rule, the kernels that write it (bit for bit against
longctx.fp8), the decode and prefill kernels that read it (against the float64 reference on the
same dequantized values, within twice the error of plain PyTorch in the same dtype), the API's
checks, and a model with an fp8 cache against its float32 cache.

The Triton interpreter's float32 -> e4m3 conversion is wrong when rounding carries into the next
binade (31.77 -> 16), so the store kernels are tested on the GPU only; the interpreter's
e4m3 -> float conversion is exact and the reading kernels run in both processes."""

from __future__ import annotations

import functools

import pytest
import torch

import longctx
from longctx.config import ModelArgs, check_decode_config
from longctx.fp8 import FP8, dequantize_kv, quantize_kv, resolve_kv_cache_dtype
from longctx.kernels.decode import flash_decode, flash_decode_partials
from longctx.kernels.prefill import flash_attention_fwd
from longctx.kernels.utils import FP_FUSION
from longctx.merge import merge_states
from longctx.model import Transformer
from longctx.parallel.memory import estimate_memory, largest_context
from longctx.reference import reference_attention
from longctx.weights import RandomWeights, load_weights
from tests.kv_rounding import RoundedKVCache


def _kv(shape, gen, device="cpu"):
    """K-like values: rows of varied norm, one outlier channel; and V; both float32."""
    k = torch.randn(shape, generator=gen) * (0.2 + 3 * torch.rand(*shape[:-1], 1, generator=gen))
    k[..., 3] *= 8
    v = torch.randn(shape, generator=gen)
    return k.to(device), v.to(device)


# ---------------------------------------------------------------- the rule (torch, CPU) -------

def test_quantize_kv_rule_and_zero_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 2, 40, generator=g) * 5
    x[1, 2, 1] = 0  # an all-zero row: scale 0, zeros, never NaN
    x_fp8, scale = quantize_kv(x)
    assert x_fp8.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (3, 7, 2)
    torch.testing.assert_close(scale, x.abs().amax(-1) / 448, rtol=0, atol=0)
    assert scale[1, 2, 1] == 0 and (x_fp8[1, 2, 1].float() == 0).all()
    back = dequantize_kv(x_fp8, scale)
    assert back.isfinite().all()
    assert (x_fp8.float().abs().amax(-1)[scale > 0] == 448).all()  # each row spans e4m3's range
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormals below 2^-6 (step 2^-9) x scale.
    assert ((back - x).abs() <= x.abs() * 2**-4 + scale[..., None] * 2**-9).all()


def test_reference_dequantizes():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 5, 6, 32, generator=g, dtype=torch.float64)
    (kq, ks), (vq, vs) = (quantize_kv(t) for t in _kv((2, 9, 2, 32), g))
    o, lse = reference_attention(q, kq, vq, causal=True, q_start=4, k_scale=ks, v_scale=vs)
    ro, rl = reference_attention(q, dequantize_kv(kq, ks, torch.float64),
                                 dequantize_kv(vq, vs, torch.float64), causal=True, q_start=4)
    assert torch.equal(o, ro) and torch.equal(lse, rl)


# ------------------------------------------------------- decode kernel (interpreter / GPU) ----

def _pages(x: torch.Tensor, table: torch.Tensor, page: int, n_pages: int) -> torch.Tensor:
    """A logical [B, S, ...] cache (or its scales) scattered into n_pages pages of `page` slots:
    page table[b, i] holds positions [i page, (i + 1) page) of sequence b; other pages hold junk."""
    B, S = x.shape[:2]
    raw = x.view(torch.uint8) if x.dtype == FP8 else x
    pad = table.shape[1] * page - S
    raw = torch.cat([raw, raw[:, :1].expand(B, pad, *raw.shape[2:])], 1) if pad else raw
    out = torch.full((n_pages, page, *raw.shape[2:]), 7, dtype=raw.dtype)
    out[table.long()] = raw.reshape(B, table.shape[1], page, *raw.shape[2:])
    return out.view(FP8) if x.dtype == FP8 else out


def _decode_case(B, S, Hq, Hkv, D, paged, dtype, device, seed=0, page=16):
    """(q, k, v, k_scale, v_scale on `device` as the kernel takes them; block table or None;
    q and the logical float64 K/V on the CPU). paged: pages of `page` slots, shuffled."""
    g = torch.Generator().manual_seed(seed)
    (kq, ks), (vq, vs) = (quantize_kv(t) for t in _kv((B, S, Hkv, D), g))
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    bt, kernel_in = None, (kq, vq, ks, vs)
    if paged:
        per_seq = -(-S // page)
        n_pages = B * per_seq + 2
        table = torch.randperm(n_pages, generator=g)[:B * per_seq].view(B, per_seq).to(torch.int32)
        kernel_in = tuple(_pages(t, table, page, n_pages) for t in kernel_in)
        bt = table.to(device)
    kc, vc, ksc, vsc = (t.to(device) for t in kernel_in)
    k64, v64 = dequantize_kv(kq, ks, torch.float64), dequantize_kv(vq, vs, torch.float64)
    return (q.to(device), kc, vc, ksc, vsc), bt, (q, k64, v64)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("B,S,Hq,Hkv,D,lens,splits", [
    (3, 97, 6, 2, 32, [97, 0, 1], 3),      # GQA group 3, lengths 0 and 1, ragged
    (2, 40, 4, 4, 48, [40, 17], 8),        # MHA, head_dim 48 (padded tile), more splits than blocks
])
def test_decode_kernel_reads_fp8(device, paged, B, S, Hq, Hkv, D, lens, splits):
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    (q, kc, vc, ks, vs), bt, (q0, k64, v64) = _decode_case(B, S, Hq, Hkv, D, paged, dtype, device)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    scale = D**-0.5
    o, lse = flash_decode(q, kc, vc, lens_t.to(device), bt, scale, splits, k_scale=ks, v_scale=vs)
    want, want_lse = reference_attention(q0[:, None].double(), k64, v64, softmax_scale=scale,
                                         seqlens_k=lens_t)
    plain, _ = reference_attention(q0[:, None], k64.to(dtype), v64.to(dtype), softmax_scale=scale,
                                   seqlens_k=lens_t, compute_dtype=dtype)
    err = (o.double().cpu() - want[:, 0]).abs().max()
    err_plain = (plain[:, 0].double() - want[:, 0]).abs().max()
    assert err <= 2 * err_plain + 1e-6, (err, err_plain)
    empty = lens_t == 0
    assert (o.cpu()[empty] == 0).all() and torch.isneginf(lse.cpu()[empty]).all()
    torch.testing.assert_close(lse.cpu()[~empty].double(), want_lse[:, 0][~empty], rtol=0, atol=2e-3)


def _key_major_with_nan_past(vq: torch.Tensor, lens: list[int], device) -> torch.Tensor:
    """vq [B, S, Hkv, D] fp8 as a key-major V on `device` (longctx.fp8.key_major_v's layout)
    whose slots from each sequence's length rounded up to 16 hold NaN bytes (0x7f): never read,
    or the output is NaN. Slots below that hold vq's values (finite, as the contract asks)."""
    from longctx.fp8 import key_major_v

    B, S, H, D = vq.shape
    v = key_major_v(vq.shape, "cpu")
    v.copy_(vq.cpu())
    padded = v.permute(0, 2, 3, 1)  # [B, Hkv, D, S], a view into [B, Hkv, D, S_pad]
    s_pad = padded.stride(2)
    base = torch.as_strided(padded, (B, H, D, s_pad), padded.stride()).clone()
    raw = base.view(torch.uint8)
    for b, n in enumerate(lens):
        raw[b, :, :, -(-n // 16) * 16:] = 0x7F
    return base.to(device)[..., :S].permute(0, 3, 1, 2)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("B,S,Hq,Hkv,D,lens,splits", [
    (3, 97, 6, 2, 32, [97, 0, 1], 3),      # GQA group 3, lengths 0 and 1, ragged
    (2, 40, 4, 4, 48, [40, 17], 8),        # head_dim 48 (padded tile), more splits than blocks
    (2, 300, 16, 2, 128, [300, 129], 2),   # the model's tile (head_dim 128, group 8)
])
def test_decode_kernel_reads_key_major_v(device, B, S, Hq, Hkv, D, lens, splits):
    """An fp8 V stored key-major gives the same output as the usual layout, and nothing past each
    length rounded up to 16 is read (NaN bytes there: the GPU widens them to NaN, which p = 0
    does not cancel; the interpreter widens 0x7f to 480, so there only the equality bites)."""
    from longctx.fp8 import is_key_major

    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    (q, kc, vc, ks, vs), _, _ = _decode_case(B, S, Hq, Hkv, D, False, dtype, device)
    vkm = _key_major_with_nan_past(vc, lens, device)
    assert is_key_major(vkm) and torch.equal(vkm[:, :min(lens)].cpu().float(),
                                             vc[:, :min(lens)].cpu().float())
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = D**-0.5
    o, lse = flash_decode(q, kc, vc, lens_t, None, scale, splits, k_scale=ks, v_scale=vs)
    o_km, lse_km = flash_decode(q, kc, vkm, lens_t, None, scale, splits, k_scale=ks, v_scale=vs)
    assert o_km.isfinite().all()
    torch.testing.assert_close(o_km, o, rtol=0, atol=1e-3)
    torch.testing.assert_close(lse_km, lse, rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("B,S,Hq,Hkv,D,lens,splits,page", [
    (3, 97, 6, 2, 32, [97, 0, 1], 3, 16),      # key blocks over several pages; lengths 0 and 1
    (2, 40, 4, 4, 48, [40, 17], 8, 64),        # a block within a page; head_dim 48 (padded)
    (2, 300, 16, 2, 128, [300, 129], 2, 128),  # the model's tile, one page a block
    (2, 300, 16, 2, 128, [300, 129], 2, 32),   # the model's tile, four pages a block
])
def test_decode_kernel_reads_paged_key_major_v(device, B, S, Hq, Hkv, D, lens, splits, page):
    """A paged fp8 cache whose pages hold V key-major (longctx.fp8.key_major_v(paged=True),
    vLLM's paged V layout; K and the scales head-major within each page, `model_layout`) gives
    the contiguous key-major cache's output bit for bit, and reads no slot from a length rounded
    up to 16 on, nor a page outside the table (NaN bytes there, 0x7f: widened to NaN on the GPU,
    which p = 0 does not cancel)."""
    from longctx.fp8 import is_key_major, key_major_v, model_layout

    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    (q, kc, vc, ks, vs), bt, _ = _decode_case(B, S, Hq, Hkv, D, True, dtype, "cpu", page=page)
    pages = model_layout(kc, vc, ks, vs, paged=True)
    pk, pv, pks, pvs = pages
    assert is_key_major(pv) and pv.stride(1) == 1 and pv.stride(3) == page
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(pages, (kc, vc, ks, vs)))
    raw = pv.view(torch.uint8)  # the same storage: NaN bytes past each length, outside the table
    used = torch.zeros(pv.shape[0], dtype=torch.bool)
    used[bt.long().flatten()] = True
    raw[~used] = 0x7F
    for b, n in enumerate(lens):
        for pos in range(-(-n // 16) * 16, bt.shape[1] * page):
            raw[bt[b, pos // page], pos % page] = 0x7F
    (q, kc, vc, ks, vs), _, _ = _decode_case(B, S, Hq, Hkv, D, False, dtype, device)
    vkm = key_major_v(vc.shape, device)
    vkm.copy_(vc)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = D**-0.5
    want, want_lse = flash_decode(q, kc, vkm, lens_t, None, scale, splits, k_scale=ks,
                                  v_scale=vs)
    pk, pv, pks, pvs = (t.to(device) for t in pages)
    assert pv.stride() == pages[1].stride()
    o, lse = flash_decode(q, pk, pv, lens_t, bt.to(device), scale, splits, k_scale=pks,
                          v_scale=pvs)
    assert o.isfinite().all()
    assert torch.equal(o, want) and torch.equal(lse, want_lse)
    # The small pages' launch (key_major_rule): 64-key blocks of 2 warps, the partial states.
    parts = [flash_decode_partials(q, *kv, lens_t, table, scale, splits, config=(64, 2, 3),
                                   k_scale=sk, v_scale=sv)
             for kv, table, sk, sv in (((kc, vkm), None, ks, vs), ((pk, pv), bt.to(device), pks,
                                                                   pvs))]
    assert parts[1][0].isfinite().all()
    assert torch.equal(parts[1][0], parts[0][0]) and torch.equal(parts[1][1], parts[0][1])


def test_key_major_rule_by_page_size():
    """A key-major V takes its own launch rule contiguous or in pages of >= 128 keys; smaller pages
    (a key block over several pages) the usual layout's (kernels/decode.py key_major_rule)."""
    from longctx.fp8 import key_major_v
    from longctx.kernels.decode import KEY_MAJOR_MIN_PAGE, key_major_rule

    assert KEY_MAJOR_MIN_PAGE == 128
    assert key_major_rule(True, key_major_v((2, 300, 2, 128), "cpu"), None)
    assert not key_major_rule(True, torch.empty(2, 300, 2, 128, dtype=FP8), None)
    for page, want in ((16, False), (64, False), (128, True), (256, True)):
        assert key_major_rule(True, key_major_v((4, page, 2, 128), "cpu", paged=True), page) == want
        assert not key_major_rule(True, torch.empty(4, page, 2, 128, dtype=FP8), page)


def _head_major_copy(x: torch.Tensor, device) -> torch.Tensor:
    """x [B, S, Hkv, ...] copied into a head-major tensor on `device` (longctx.fp8.head_major's
    layout: physically [B, Hkv, S_pad, ...], the model's fp8 K and scales) whose padding past S
    holds NaN (0x7f bytes in e4m3), which no read may touch."""
    from longctx.fp8 import head_major

    whole = head_major(x.shape, x.dtype, "cpu").transpose(1, 2)  # [B, Hkv, S, ...] of S_pad
    rows = whole.stride(1) // whole[0, 0, 0].numel()  # S_pad
    base = torch.as_strided(whole, (*whole.shape[:2], rows, *whole.shape[3:]),
                            whole.stride()).clone()
    if x.dtype == torch.float32:
        base.fill_(float("nan"))
    else:
        base.view(torch.uint8).fill_(0x7F)
    base[:, :, :x.shape[1]] = x.transpose(1, 2).cpu()
    return base.to(device)[:, :, :x.shape[1]].transpose(1, 2)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("B,S,Hq,Hkv,D,lens,splits", [
    (3, 97, 6, 2, 32, [97, 0, 1], 3),      # GQA group 3, lengths 0 and 1, ragged
    (2, 300, 16, 2, 128, [300, 129], 2),   # the model's tile (head_dim 128, group 8)
    (1, 200, 5, 5, 64, [200], 4),          # MHA, 5 KV heads
])
def test_decode_kernel_reads_head_major_k_and_scales(device, B, S, Hq, Hkv, D, lens, splits):
    """The model's fp8 cache layout (K and both scales head-major, longctx.fp8.head_major; V
    key-major) gives the usual layout's output bit for bit (only the strides differ), for either
    V layout, and reads nothing in the head-major rows' padding (NaN there)."""
    from longctx.fp8 import key_major_v

    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    (q, kc, vc, ks, vs), _, _ = _decode_case(B, S, Hq, Hkv, D, False, dtype, device)
    vkm = key_major_v(vc.shape, device)
    vkm.copy_(vc)
    khm, kshm, vshm = (_head_major_copy(t, device) for t in (kc, ks, vs))
    assert khm.stride(1) == D and kshm.stride(1) == 1 and torch.equal(kshm.cpu(), ks.cpu())
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = D**-0.5
    for v, name in ((vc, "usual V"), (vkm, "key-major V")):
        o, lse = flash_decode(q, kc, v, lens_t, None, scale, splits, k_scale=ks, v_scale=vs)
        o_hm, lse_hm = flash_decode(q, khm, v, lens_t, None, scale, splits, k_scale=kshm,
                                    v_scale=vshm)
        assert torch.equal(o_hm, o) and torch.equal(lse_hm, lse), name


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("Sq,D", [(37, 32), (150, 128), (130, 256)])
def test_prefill_kernel_reads_fp8_history(device, Sq, D):
    """A chunk of queries (q_start past the history) over the fp8 cache up to the chunk's end,
    causal by absolute position; odd lengths, GQA group 3; on the GPU each fp8 launch config
    (short chunk, D <= 128, D > 128)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    g = torch.Generator().manual_seed(2)
    B, Sk, Hq, Hkv = 2, 101 + Sq, 6, 2
    k, v = _kv((B, Sk, Hkv, D), g)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    q = torch.randn(B, Sq, Hq, D, generator=g).to(dtype)
    start = Sk - Sq
    o, lse = flash_attention_fwd(q.to(device), kq.to(device), vq.to(device), softmax_scale=D**-0.5,
                                 causal=True, q_start=start, k_start=0, k_scale=ks.to(device),
                                 v_scale=vs.to(device))
    k64, v64 = dequantize_kv(kq, ks, torch.float64), dequantize_kv(vq, vs, torch.float64)
    want, want_lse = reference_attention(q.double(), k64, v64, causal=True, q_start=start)
    plain, _ = reference_attention(q, k64.to(dtype), v64.to(dtype), causal=True, q_start=start,
                                   compute_dtype=dtype)
    err, err_plain = ((o.double().cpu() - want).abs().max(), (plain.double() - want).abs().max())
    assert err <= 2 * err_plain + 1e-6, (err, err_plain)
    torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=0, atol=2e-3)


def _fp8_chunk_case(B, Sq, hist, Hq, Hkv, D, seed, late, dtype=torch.bfloat16):
    """A chunk of Sq queries in `dtype` at the end of hist + Sq fp8 keys (causal; k_start `late`
    keys past q_start, so the first `late` rows see no key) on the CPU, with its references:
    (q, kq, vq, ks, vs, kw, want, want_lse, want_lse_q, err_plain): the float64 output and LSE
    on the exact dequantized values, the float64 LSE on the values rounded to `dtype` (what
    dequantized blocks attend to), and plain PyTorch's max error of `want` in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    k, v = _kv((B, hist + Sq, Hkv, D), g)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    q = torch.randn(B, Sq, Hq, D, generator=g).to(dtype)
    k64, v64 = dequantize_kv(kq, ks, torch.float64), dequantize_kv(vq, vs, torch.float64)
    kw = dict(causal=True, q_start=hist, k_start=hist + late if late else 0)
    want, want_lse = reference_attention(q.double(), k64, v64, **kw)
    kr, vr = k64.to(dtype), v64.to(dtype)
    plain, _ = reference_attention(q, kr, vr, **kw, compute_dtype=dtype)
    _, want_lse_q = reference_attention(q.double(), kr.double(), vr.double(), **kw)
    return q, kq, vq, ks, vs, kw, want, want_lse, want_lse_q, (plain.double() - want).abs().max()


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("k_start", ["0", "tensor", "late"])
def test_fp8_blocks_merge_to_the_whole_history(device, monkeypatch, k_start):
    """kernels/prefill.py `_attend_fp8_blocks` itself (what a long enough chunk over an fp8
    history runs on sm_90), on the `device` fixture: blocks of 40 keys over 130 (the last one
    short), each block's offset, rows that see no key ("late": k_start 3 past q_start, O = 0 and
    LSE = -inf). O within twice plain PyTorch's error of the float64 reference on the exact
    dequantized values; the LSE to the float64 one on the values rounded to q's dtype, which the
    blocks attend to."""
    from longctx.kernels import prefill as kp

    monkeypatch.setattr(kp, "FP8_DEQUANT_KEYS", 40)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    B, D = 2, 32
    q, kq, vq, ks, vs, kw, want, _, want_lse, err_plain = _fp8_chunk_case(
        B, 37, 93, 6, 2, D, 5, 3 if k_start == "late" else 0, dtype)
    if k_start == "tensor":
        kw["k_start"] = torch.zeros(B, dtype=torch.int64, device=device)
    to = functools.partial(torch.Tensor.to, device=device)
    args = (to(q), to(kq), to(vq), to(ks), to(vs), D**-0.5, True, kw["q_start"], kw["k_start"])
    o, lse = kp._attend_fp8_blocks(*args, None)
    assert o.dtype == dtype and lse.dtype == torch.float32
    err = (o.double().cpu() - want).abs().max()
    assert err <= 2 * err_plain + 1e-6, (err, err_plain)
    torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=0, atol=2e-3)
    if k_start == "late":
        assert (o[:, :3] == 0).all() and (lse[:, :3] == float("-inf")).all()
        assert (lse[:, 3:] > float("-inf")).all()
    # Merged into a caller's running state (a ring step's `accumulate`): the blocks fold into
    # it, as merging their (O, LSE) into it would, rather than replacing it.
    g = torch.Generator().manual_seed(7)
    o_run = torch.randn(q.shape, generator=g)
    lse_run = torch.randn(q.shape[:3], generator=g)
    want_o, want_l = merge_states(torch.stack([o_run.double(), want]),
                                  torch.stack([lse_run.double(), want_lse]))
    acc = (to(o_run), to(lse_run))
    assert kp._attend_fp8_blocks(*args, acc) is None
    assert (acc[0].cpu().double() - want_o).abs().max() <= 2 * err_plain + 1e-6
    torch.testing.assert_close(acc[1].cpu().double(), want_l, rtol=0, atol=2e-3)


def _count_blocks(monkeypatch, keys: int) -> list:
    """kernels/prefill.py's blocks made `keys` keys long, and a list that each call of
    `_attend_fp8_blocks` appends to."""
    from longctx.kernels import prefill as kp

    monkeypatch.setattr(kp, "FP8_DEQUANT_KEYS", keys)
    calls = []
    blocks = kp._attend_fp8_blocks
    monkeypatch.setattr(kp, "_attend_fp8_blocks", lambda *a: calls.append(1) or blocks(*a))
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("D,layout,k_start", [(128, "model", "0"), (96, "usual", "0"),
                                              (128, "model", "tensor"), (64, "usual", "late")])
def test_prefill_fp8_blocks_on_the_hopper_kernel(monkeypatch, D, layout, k_start):
    """On sm_90 a chunk long enough for the Gluon kernel (causal, >= 2048 rows) over an fp8
    history runs as dequantized key blocks merged by that kernel (kernels/prefill.py
    `_attend_fp8_blocks`; blocks of 1000 keys here, the last one short): within twice plain
    bf16 PyTorch's error of the float64 reference on the same dequantized values, through the
    API's fast path and Triton's, with the model's layout (K and scales head-major, V key-major)
    or the usual one; k_start an int, a [B] tensor, or 5 past q_start ("late": the first 5 rows
    see no key, O = 0 and LSE = -inf). The blocks attend to K / V rounded to q's dtype, as plain
    PyTorch in that dtype does, so their LSE is held to the float64 one on those values (the
    Triton kernel's, which widens e4m3 exactly, to the float64 one on the dequantized values)."""
    from longctx.fp8 import model_layout
    from longctx.kernels import prefill as kp
    from longctx.kernels.utils import device_capability

    if device_capability(torch.device("cuda")) != (9, 0):
        pytest.skip("the Gluon prefill kernel runs on sm_90 only")
    calls = _count_blocks(monkeypatch, 1000)
    B = 2
    q, kq, vq, ks, vs, kw, want, want_lse, want_lse_q, err_plain = _fp8_chunk_case(
        B, 2100, 700, 6, 2, D, 4, 5 if k_start == "late" else 0)
    cache = tuple(t.cuda() for t in (kq, vq, ks, vs))
    if layout == "model":
        cache = model_layout(*cache)
    kc, vc, ksc, vsc = cache
    qc = q.cuda()
    if k_start == "tensor":
        kw["k_start"] = torch.zeros(B, dtype=torch.int32, device="cuda")
    for path in ("api", "triton_path"):
        if path == "api":
            o, lse = longctx.attention(qc, kc, vc, k_scale=ksc, v_scale=vsc, return_lse=True, **kw)
        else:
            o, lse = flash_attention_fwd(qc, kc, vc, softmax_scale=D**-0.5, k_scale=ksc,
                                         v_scale=vsc, **kw)
        err = (o.double().cpu() - want).abs().max()
        assert err <= 2 * err_plain + 1e-6, (path, err, err_plain)
        torch.testing.assert_close(lse.cpu().double(), want_lse_q, rtol=0, atol=2e-3)
        if k_start == "late":
            assert (o[:, :5] == 0).all() and (lse[:, :5] == float("-inf")).all()
    assert len(calls) == 2  # both calls took the blocks
    with kp.prefill_kernel("triton"):  # 2800 keys: the Triton kernel widens e4m3 itself
        o_t, lse_t = flash_attention_fwd(qc, kc, vc, softmax_scale=D**-0.5, k_scale=ksc,
                                         v_scale=vsc, **kw)
    assert len(calls) == 2
    assert (o_t.double().cpu() - want).abs().max() <= 2 * err_plain + 1e-6
    torch.testing.assert_close(lse_t.cpu().double(), want_lse, rtol=0, atol=2e-3)


@pytest.mark.parametrize("cap,Sq,Sk,causal,gluon,config,want", [
    ((9, 0), 1, 16384, True, True, False, True),       # from 16384 keys, any rows
    ((9, 0), 1024, 16384, False, False, False, True),
    ((9, 0), 1024, 16383, True, True, False, False),
    ((9, 0), 2048, 2048, True, True, False, True),     # the Gluon kernel's rule (causal)
    ((9, 0), 2048, 2048, True, False, False, False),   # ... not without it
    ((9, 0), 1024, 2048, False, True, False, True),    # its rule unmasked: 64 x 8 programs
    ((9, 0), 1024, 2048, False, False, False, False),
    ((9, 0), 16384, 65536, True, True, True, False),   # a _config keeps the Triton kernel's form
    ((9, 0), 0, 65536, True, True, False, False),
    ((8, 9), 8192, 65536, True, True, False, False),   # measured on sm_90 only
    ((10, 0), 8192, 65536, True, True, False, False),
    (None, 8192, 65536, True, True, False, False),
])
def test_fp8_blocks_rule(cap, Sq, Sk, causal, gluon, config, want):
    """kernels/prefill.py `fp8_blocks_apply` (pure): where a dense fp8 call runs as dequantized
    blocks rather than the Triton kernel widening e4m3 tiles (64 / 8 heads, D=128; a bf16 or
    fp16 q, never a float32 one)."""
    from longctx.kernels.prefill import fp8_blocks_apply

    q_shape = (1, Sq, 64, 128)
    q_strides = (Sq * 64 * 128, 64 * 128, 128, 1)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):  # float32: not measured
        assert fp8_blocks_apply(q_shape=q_shape, k_shape=(1, Sk, 8, 128), q_strides=q_strides,
                                dtype=dtype, capability=cap, causal=causal,
                                config_given=config, gluon=gluon) is (want and dtype.itemsize == 2)


@pytest.mark.gpu
@pytest.mark.parametrize("k_start", ["0", "late"])
def test_prefill_fp8_blocks_on_the_triton_kernel(monkeypatch, k_start):
    """On sm_90 a chunk too short for the Gluon kernel (300 causal rows) over 16384 + 300 fp8
    keys runs as dequantized blocks through the Triton kernel (`fp8_blocks_apply`; blocks of 6000
    keys here, the last one short), through the API and Triton's path, and still under
    prefill_kernel("triton"); with ``_config`` the Triton kernel widens the tiles itself. Each
    within twice plain bf16 PyTorch's error of the float64 reference on the dequantized values;
    the blocks' LSE against the float64 one on the values rounded to bf16 (what they attend to),
    the widening's against the float64 one on the exact values. "late": the first 5 rows see no
    key (O = 0, LSE = -inf)."""
    from longctx.kernels import prefill as kp
    from longctx.kernels.utils import device_capability

    if device_capability(torch.device("cuda")) != (9, 0):
        pytest.skip("fp8_blocks_apply sends the Triton kernel dequantized blocks on sm_90 "
                    "only (where the rule was measured)")
    calls = _count_blocks(monkeypatch, 6000)
    Sq, hist, D = 300, 16384, 128
    q, kq, vq, ks, vs, kw, want, want_lse, want_lse_q, err_plain = _fp8_chunk_case(
        1, Sq, hist, 6, 2, D, 6, 5 if k_start == "late" else 0)
    qc, kc, vc, ksc, vsc = (t.cuda() for t in (q, kq, vq, ks, vs))
    cfg = kp.launch_config(D, q.dtype, True, Sq, hist + Sq, fp8=True, capability=(9, 0))
    runs = {
        "api": lambda: longctx.attention(qc, kc, vc, k_scale=ksc, v_scale=vsc, return_lse=True,
                                         **kw),
        "triton_path": lambda: flash_attention_fwd(qc, kc, vc, softmax_scale=D**-0.5,
                                                   k_scale=ksc, v_scale=vsc, **kw),
        "forced": lambda: flash_attention_fwd(qc, kc, vc, softmax_scale=D**-0.5, k_scale=ksc,
                                              v_scale=vsc, **kw),
        "widened": lambda: flash_attention_fwd(qc, kc, vc, softmax_scale=D**-0.5, k_scale=ksc,
                                               v_scale=vsc, _config=cfg, **kw),
    }
    for name, run in runs.items():
        n = len(calls)
        if name == "forced":
            with kp.prefill_kernel("triton"):
                o, lse = run()
        else:
            o, lse = run()
        assert len(calls) == n + (name != "widened"), name
        err = (o.double().cpu() - want).abs().max()
        assert err <= 2 * err_plain + 1e-6, (name, err, err_plain)
        torch.testing.assert_close(lse.cpu().double(),
                                   want_lse if name == "widened" else want_lse_q, rtol=0,
                                   atol=2e-3)
        if k_start == "late":
            assert (o[:, :5] == 0).all() and (lse[:, :5] == float("-inf")).all()


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("q_mag,v_mag", [(1.0, 1e-4), (1.0, 1e4), (1e-6, 1.0), (1e5, 1.0)])
def test_decode_fp8_any_magnitude(device, q_mag, v_mag):
    """The kernel's dots run in float16 on the widened tiles: q is scaled into [-1, 1] and the
    probabilities times V's scales are taken relative to the largest V scale, so tiny or huge
    q and V (float16 subnormals or overflow otherwise: 23% error at V ~ 1e-4) keep the
    precision of a plain bf16 computation. A zero V row and a zero K row ride along. (On the
    CPU q is float16 itself, so its magnitudes test nothing there and 1e5 cannot be held.)"""
    if device != "cuda" and q_mag > 6e4:
        # the interpreter's bf16 arithmetic is wrong, so the CPU run takes a float16 q, whose
        # largest value is 65504: q x 1e5 is a bf16 (GPU) case only
        pytest.skip("q x 1e5 needs a bf16 q (GPU); the CPU run's float16 q tops out at 65504")
    g = torch.Generator().manual_seed(9)
    B, S, Hq, Hkv, D = 2, 300, 8, 2, 64
    k, v = _kv((B, S, Hkv, D), g)
    v = v * v_mag
    v[0, 7] = 0
    k[1, 3] = 0
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    q = (torch.randn(B, Hq, D, generator=g) * q_mag).to(dtype)
    k64, v64 = dequantize_kv(kq, ks, torch.float64), dequantize_kv(vq, vs, torch.float64)
    lens = torch.tensor([S, 211], dtype=torch.int32)
    o, _ = flash_decode(q.to(device), kq.to(device), vq.to(device), lens.to(device), None,
                        D**-0.5, 3, k_scale=ks.to(device), v_scale=vs.to(device))
    want, _ = reference_attention(q[:, None].double(), k64, v64, softmax_scale=D**-0.5,
                                  seqlens_k=lens)
    # plain PyTorch in bf16 (on the CPU too: float16 would lose V ~ 1e-4 to subnormals itself)
    plain, _ = reference_attention(q[:, None].to(torch.bfloat16), k64.to(torch.bfloat16),
                                   v64.to(torch.bfloat16), softmax_scale=D**-0.5, seqlens_k=lens,
                                   compute_dtype=torch.bfloat16)
    err = (o.double().cpu() - want[:, 0]).abs().max()
    err_plain = (plain[:, 0].double() - want[:, 0]).abs().max()
    assert o.isfinite().all() and err <= 2 * err_plain, (err, err_plain)


# --------------------------------------------------------------- store kernels (GPU) ---------

@pytest.mark.gpu
def test_store_kernels_match_the_rule_bit_for_bit():
    """store_fp8 (a prefill chunk) and rope_store_kv (a decode step) on the GPU write the e4m3
    values and scales of longctx.fp8.quantize_kv exactly, zero rows included."""
    from longctx import ops
    from longctx.kernels import fused

    g = torch.Generator().manual_seed(3)
    B, S, Hq, Hkv, D = 3, 33, 12, 4, 128
    x = (torch.randn(B, 20, Hkv, D, generator=g) * 3).to(torch.bfloat16)
    x[0, 5, 1] = 0
    dst = torch.zeros(B, S, Hkv, D, dtype=FP8, device="cuda")
    sc = torch.zeros(B, S, Hkv, device="cuda")
    fused.store_fp8(dst[:, 7:27], sc[:, 7:27], x.cuda())
    want, want_s = quantize_kv(x)
    assert torch.equal(dst[:, 7:27].cpu().view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(sc[:, 7:27].cpu(), want_s)
    assert sc[:, :7].count_nonzero() == 0 and sc[:, 27:].count_nonzero() == 0

    # A decode step: rope_store_kv rotates k in place (its rounding on CUDA may differ from
    # torch's by FMA contraction) and stores quantize_kv of that k and of v at each slot.
    cos, sin = ops.rope_tables(S, D, 1e4, torch.device("cuda"))
    q = torch.randn(B, Hq, D, generator=g).to(torch.bfloat16).cuda()
    k = (torch.randn(B, Hkv, D, generator=g) * 4).to(torch.bfloat16).cuda()
    v = torch.randn(B, Hkv, D, generator=g).to(torch.bfloat16).cuda()
    k[1, 2] = 0
    v[2, 0] = 0
    pos = torch.tensor([0, 13, 32], device="cuda")
    kc, vc = (torch.zeros(B, S, Hkv, D, dtype=FP8, device="cuda") for _ in range(2))
    kss, vss = (torch.zeros(B, S, Hkv, device="cuda") for _ in range(2))
    ops.rope_store_kv(q, k, v, cos, sin, pos, kc, vc, pos, kss, vss)
    b = torch.arange(B, device="cuda")
    for cache, scale, x in ((kc, kss, k), (vc, vss, v)):
        want, want_s = quantize_kv(x.cpu())
        assert torch.equal(cache.view(torch.uint8)[b, pos].cpu(), want.view(torch.uint8))
        assert torch.equal(scale[b, pos].cpu(), want_s)
        assert scale.count_nonzero() == (want_s != 0).sum()  # nothing else written


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("D", [64, 96])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_dequantize_kernel_matches_the_rule_bit_for_bit(device, D):
    """kernels/fused.py dequantize_fp8 (what the fp8 blocks of a prefill chunk and a
    sequence-parallel chunk read through) writes longctx.fp8.dequantize_kv's values bit for bit:
    every finite e4m3 byte, scales from 0 and 1e-30 (products below the output's subnormals) to
    1e30 (past float16's range), an odd length, the usual layout and the model's (K and scales
    head-major, V key-major), into float16 / float32, and bfloat16 on the GPU (the interpreter's
    bfloat16 is not the hardware's). Refuses an x, scale or out it cannot take, naming it."""
    from longctx import ops
    from longctx.fp8 import model_layout
    from longctx.kernels.fused import dequantize_fp8

    g = torch.Generator().manual_seed(6)
    B, S, H = 2, 77, 3
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    pick = torch.randint(0, finite.numel(), (2, B, S, H, D), generator=g)
    kq, vq = finite[pick].view(FP8)
    ks, vs = torch.exp2(torch.randint(-12, 4, (2, B, S, H), generator=g).float()) * (
        1 + torch.rand(2, B, S, H, generator=g))
    ks[0, :3] = torch.tensor([0.0, 1e-30, 1e30])[:, None]
    vs[1, -3:] = torch.tensor([1e30, 0.0, 1e-30])[:, None]
    cache = tuple(t.to(device) for t in (kq, vq, ks, vs))
    dtypes = [torch.float16, torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    for layout in ("usual", "model"):
        kc, vc, ksc, vsc = cache if layout == "usual" else model_layout(*cache)
        for dtype in dtypes:
            for x, sc, x_cpu, sc_cpu in ((kc, ksc, kq, ks), (vc, vsc, vq, vs)):
                want = dequantize_kv(x_cpu, sc_cpu, dtype)
                out = torch.full(x.shape, float("nan"), dtype=dtype, device=device)
                assert dequantize_fp8(x, sc, out) is out
                assert torch.equal(out.cpu().view(torch.uint8), want.view(torch.uint8)), (
                    layout, dtype)
                got = ops.dequantize_kv(x[:, 5:6], sc[:, 5:6], dtype)  # one key, a view
                assert got.is_contiguous()
                assert torch.equal(got.cpu().view(torch.uint8), want[:, 5:6].view(torch.uint8))
    empty = torch.empty(B, 0, H, D, dtype=torch.float16, device=device)
    assert dequantize_fp8(kc[:, :0], ksc[:, :0], empty) is empty
    with pytest.raises(ValueError, match="out must be contiguous"):
        dequantize_fp8(kc, ksc, torch.empty(B, S, H, D, device=device).transpose(1, 2))
    with pytest.raises(ValueError, match="out must be contiguous"):
        dequantize_fp8(kc, ksc, torch.empty(B, S - 1, H, D, device=device))
    with pytest.raises(ValueError, match="scale must be"):
        dequantize_fp8(kc, ksc[:, 1:], torch.empty(B, S, H, D, device=device))
    with pytest.raises(ValueError, match="x must be float8_e4m3fn"):
        dequantize_fp8(out, ksc, torch.empty(B, S, H, D, device=device))


@pytest.mark.gpu
def test_div_rows_rounds_as_torch_divides():
    """The fp8 writers' division (kernels.fused._div_rows: a reciprocal per row and two FMA
    corrections per element) is torch's correctly rounded float32 quotient for every quotient
    e4m3 can tell from zero (|a / b| >= 2^-11), at divisors from subnormal to huge and
    dividends from the row's max down to tiny and -0, and the same e4m3 value for all of them."""
    import triton
    import triton.language as tl

    from longctx.kernels.fused import _div_rows

    @triton.jit
    def probe(A, B_, Q, C: tl.constexpr):
        r = tl.program_id(0)
        offs = r * C + tl.arange(0, C)[None, :]
        tl.store(Q + offs, _div_rows(tl.load(A + offs), tl.load(B_ + r + tl.arange(0, 1))))

    g = torch.Generator(device="cuda").manual_seed(11)
    R, C = 4096, 512
    # Divisors 2^e (1 + u), e in [-149, 117]: subnormal, tiny, ordinary and huge rows.
    e = torch.randint(-149, 118, (R,), generator=g, device="cuda").double()
    b = (torch.exp2(e) * (1 + torch.rand(R, generator=g, device="cuda",
                                          dtype=torch.float64))).float()
    b = torch.where(b > 0, b, torch.full_like(b, 2.0 ** -149))
    # Dividends up to the row's 448 b, many scaled down by 2^-k (k up to 40).
    u = torch.rand(R, C, generator=g, device="cuda", dtype=torch.float64) * 2 - 1
    k = torch.randint(0, 41, (R, C), generator=g, device="cuda").double()
    k[:, : C // 2] = 0
    a = (448 * b.double()[:, None] * u * torch.exp2(-k)).float()
    a[:, 0] = 448 * b  # the row's max
    a[:, 1] = -0.0  # a zero keeps its sign
    q = torch.empty_like(a)
    probe[(R,)](a, b, q, C=C, **FP_FUSION)  # as the cache writers launch _div_rows
    want = a / b[:, None]
    big = want.abs() >= 2.0 ** -11
    assert big.sum() > R * C // 2
    torch.testing.assert_close(q[big], want[big], rtol=0, atol=0)
    assert torch.equal(q.to(FP8).view(torch.uint8), want.to(FP8).view(torch.uint8))


@pytest.mark.gpu
def test_fp8_api_fast_launch_and_cuda_graph():
    """On CUDA longctx.decode (its cached plan, launched directly) and longctx.attention take the
    fp8 cache; a captured decode replays correctly as cache_seqlens grow (no host sync)."""
    g = torch.Generator().manual_seed(8)
    B, S, Hq, Hkv, D = 2, 3000, 24, 8, 128
    (kq, ks), (vq, vs) = (tuple(x.cuda() for x in quantize_kv(t)) for t in _kv((B, S, Hkv, D), g))
    q = torch.randn(B, Hq, D, generator=g).to(torch.bfloat16).cuda()
    k64, v64 = (dequantize_kv(x.cpu(), s.cpu(), torch.float64) for x, s in ((kq, ks), (vq, vs)))
    lens = torch.tensor([1000, 1], dtype=torch.int32, device="cuda")

    def check(o, n):
        want, _ = reference_attention(q.cpu()[:, None].double(), k64, v64, seqlens_k=n.cpu())
        plain, _ = reference_attention(q.cpu()[:, None], k64.bfloat16(), v64.bfloat16(),
                                       seqlens_k=n.cpu(), compute_dtype=torch.bfloat16)
        err = (o.cpu().double() - want[:, 0]).abs().max()
        err_plain = (plain[:, 0].double() - want[:, 0]).abs().max()
        assert err <= 2 * err_plain + 1e-6, (err, err_plain)

    for _ in range(2):  # the first call builds the plan, the second launches it directly
        check(longctx.decode(q, kq, vq, cache_seqlens=lens, k_scale=ks, v_scale=vs), lens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = longctx.decode(q, kq, vq, cache_seqlens=lens, k_scale=ks, v_scale=vs)
    lens.copy_(torch.tensor([2999, 17], dtype=torch.int32))
    graph.replay()
    check(o, lens)
    # Prefill over the fp8 history (a chunk of 300 queries at the end), the fast path twice.
    qp = torch.randn(B, 300, Hq, D, generator=g).to(torch.bfloat16).cuda()
    for _ in range(2):
        o = longctx.attention(qp, kq, vq, causal=True, q_start=S - 300, k_scale=ks, v_scale=vs)
    want, _ = reference_attention(qp.cpu().double(), k64, v64, causal=True, q_start=S - 300)
    plain, _ = reference_attention(qp.cpu(), k64.bfloat16(), v64.bfloat16(), causal=True,
                                   q_start=S - 300, compute_dtype=torch.bfloat16)
    assert (o.cpu().double() - want).abs().max() <= 2 * (plain.double() - want).abs().max() + 1e-6


# ----------------------------------------------------------------- API checks (CPU) ---------

def _api_case(S=8):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 16, generator=g)
    (kq, ks), (vq, vs) = (quantize_kv(t) for t in _kv((2, S, 2, 16), g))
    return q, kq, vq, ks, vs


def test_decode_api_fp8_on_cpu_is_the_dequantized_reference():
    q, kq, vq, ks, vs = _api_case(S=32)
    lens = torch.tensor([32, 19], dtype=torch.int32)
    o = longctx.decode(q, kq, vq, k_scale=ks, v_scale=vs, cache_seqlens=lens)
    want, _ = reference_attention(q[:, None], dequantize_kv(kq, ks), dequantize_kv(vq, vs),
                                  seqlens_k=lens)
    torch.testing.assert_close(o, want[:, 0], rtol=1e-6, atol=1e-6)
    # Paged: the scales follow the block table as the cache does.
    table = torch.tensor([[1, 3], [2, 0]], dtype=torch.int32)
    paged = [_pages(t, table, 16, 5) for t in (kq, vq, ks, vs)]
    o_paged = longctx.decode(q, paged[0], paged[1], k_scale=paged[2], v_scale=paged[3],
                             block_table=table, cache_seqlens=lens)
    torch.testing.assert_close(o_paged, o, rtol=0, atol=0)


def test_decode_api_key_major_v_and_its_refusals():
    """A key-major fp8 v_cache (longctx.fp8.key_major_v) gives the usual layout's output on the
    CPU path; layouts the kernels cannot read are refused naming v_cache."""
    from longctx.fp8 import key_major_v

    q, kq, vq, ks, vs = _api_case(S=37)
    lens = torch.tensor([37, 20], dtype=torch.int32)
    vkm = key_major_v(vq.shape, "cpu")
    vkm.copy_(vq)
    o = longctx.decode(q, kq, vq, k_scale=ks, v_scale=vs, cache_seqlens=lens)
    o_km = longctx.decode(q, kq, vkm, k_scale=ks, v_scale=vs, cache_seqlens=lens)
    torch.testing.assert_close(o_km, o, rtol=0, atol=0)
    unpadded = vq.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # rows of 37 keys
    with pytest.raises(ValueError, match="v_cache is key-major .* multiple of 16 and >= 48"):
        longctx.decode(q, kq, unpadded, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="v_cache must have unit stride in its last .*only an fp8"):
        f = vq.float()
        longctx.decode(q, f, f.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2))
    # Paged: each page's V key-major (rows of page_size keys).
    table = torch.tensor([[3, 1, 4], [0, 2, 5]], dtype=torch.int32)
    pk, pv, pks, pvs = (_pages(t, table, 16, 6) for t in (kq, vq, ks, vs))
    pvkm = key_major_v(pv.shape, "cpu", paged=True)
    pvkm.copy_(pv)
    assert pvkm.stride() == (2 * 16 * 16, 1, 16 * 16, 16)
    o_p, o_pkm = (longctx.decode(q, pk, v, k_scale=pks, v_scale=pvs, block_table=table,
                                 cache_seqlens=lens) for v in (pv, pvkm))
    torch.testing.assert_close(o_pkm, o_p, rtol=0, atol=0)
    torch.testing.assert_close(o_pkm, o, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="page_size .* must be a power of two >= 16, got 24"):
        key_major_v((6, 24, 2, 16), "cpu", paged=True)


@pytest.mark.parametrize("change,match", [
    (dict(k_scale=None), "an fp8 k_cache needs k_scale"),
    (dict(v_scale=None), "an fp8 v_cache needs v_scale"),
    (dict(k_scale="half"), "k_scale must be float32"),
    (dict(v_scale="shape"), r"v_scale must have v_cache's shape without head_dim \(2, 8, 2\)"),
    (dict(k_scale="meta"), "k_scale is on meta but q is on cpu"),
    (dict(k_scale="list"), "k_scale must be a torch.Tensor"),
    (dict(v_cache="bf16"), "v_cache has dtype torch.bfloat16 but k_cache has"),
    (dict(k_cache="f32", v_cache="f32"),
     r"k_scale is for an fp8 \(torch.float8_e4m3fn\) k_cache; k_cache is torch.float32"),
])
def test_decode_api_refuses_bad_fp8_arguments(change, match):
    q, kq, vq, ks, vs = _api_case()
    args = dict(k_cache=kq, v_cache=vq, k_scale=ks, v_scale=vs)
    for name, how in change.items():
        t = args[name]
        args[name] = {None: None, "half": t.half() if isinstance(t, torch.Tensor) else t,
                      "shape": t[:, :7] if isinstance(t, torch.Tensor) else t,
                      "meta": t.to("meta") if isinstance(t, torch.Tensor) else t,
                      "list": [1.0], "bf16": torch.zeros(kq.shape, dtype=torch.bfloat16),
                      "f32": torch.zeros(kq.shape)}[how]
    with pytest.raises(ValueError, match=match):
        longctx.decode(q, **args)


def test_attention_api_fp8_checks():
    q, kq, vq, ks, vs = _api_case()
    q4 = torch.randn(2, 3, 4, 16, generator=torch.Generator().manual_seed(6))
    o = longctx.attention(q4, kq, vq, causal=True, q_start=5, k_scale=ks, v_scale=vs)
    want, _ = reference_attention(q4, dequantize_kv(kq, ks), dequantize_kv(vq, vs), causal=True,
                                  q_start=5)
    torch.testing.assert_close(o, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="an fp8 k needs k_scale"):
        longctx.attention(q4, kq, vq)
    with pytest.raises(ValueError, match="not varlen"):
        cu = torch.tensor([0, 8], dtype=torch.int32)
        longctx.attention(q4[0], kq[0], vq[0], cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
                          cu_seqlens_k=cu, k_scale=ks[0], v_scale=vs[0])


# ------------------------------------------------------ config, memory, model (CPU) ---------

def test_prefill_launch_config_for_fp8():
    from longctx.kernels import prefill as P

    assert P.launch_config(128, torch.bfloat16, True, 4096, 4096, fp8=True) == \
        P._config_dict(P._FP8_HALF, False)
    assert P.launch_config(256, torch.bfloat16, True, 4096, 4096, fp8=True) == \
        P._config_dict(P._FP8_D256, False)
    assert P.launch_config(128, torch.bfloat16, True, 64, 4096, fp8=True) == \
        P._config_dict(P._HALF_SHORT_Q, False)


def test_kv_cache_dtype_config_and_memory():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) == FP8
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3, got 'fp8'"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16)
    from hydra import compose, initialize_config_dir
    from pathlib import Path
    from omegaconf import OmegaConf

    with initialize_config_dir(str(Path(__file__).parents[1] / "configs"), version_base=None):
        cfg = OmegaConf.to_container(compose("decode", overrides=["kv_cache_dtype=fp8"]))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        check_decode_config(cfg)
    # CodeLlama-34B at tp=2: the fp8 cache is (1 + 4/128) / 2 of bf16's bytes, plus the
    # smoothing means: K's and V's [1, 4, 128] float32 a layer.
    args = ModelArgs(name="cl34", n_layers=48, dim=8192, n_heads=64, n_kv_heads=8, head_dim=128,
                     intermediate_size=22016, vocab_size=32000)
    kw = dict(tp=2, sp=1, batch=1, prompt_len=0, max_seq_len=1 << 20, dtype=torch.bfloat16,
              device_type="cuda")
    bf16, fp8 = estimate_memory(args, **kw), estimate_memory(args, **kw, kv_cache_dtype=FP8)
    plain = estimate_memory(args, **kw, kv_cache_dtype=FP8, kv_smoothing=False)
    assert plain.kv_cache == bf16.kv_cache * (1 + 4 / 128) / 2
    assert fp8.kv_cache == plain.kv_cache + 48 * 2 * 4 * 128 * 4
    assert fp8.weights == bf16.weights
    h200 = int(139.8 * 2**30)
    big = dict(tp=2, sp=1, available=h200, batch=1, gen_len=64, dtype=torch.bfloat16,
               device_type="cuda", synthetic=True)
    n_bf16, n_fp8 = largest_context(args, **big), largest_context(args, **big, kv_cache_dtype=FP8)
    assert 1.9 < n_fp8 / n_bf16 < 2 / (1 + 4 / 128) + 0.01
    assert args.decode_bytes(1, 1000, 2, 1 + 4 / 128)["kv_cache"] == \
        args.decode_bytes(1, 1000, 2)["kv_cache"] * (1 + 4 / 128) / 2
    # A real prefill on CUDA: an fp8 cache's attention holds at least a float32 running output
    # of the chunk and one dequantized block of K and V (kernels/prefill.py); not on the CPU.
    from longctx.kernels.prefill import FP8_DEQUANT_KEYS

    for device_type, least in (("cuda", 8192 * 32 * 128 * 4 + 2 * FP8_DEQUANT_KEYS * 4 * 128 * 2),
                               ("cpu", 0)):
        real = dict(kw, prompt_len=262144, prefill_chunk=8192, device_type=device_type)
        grow = (estimate_memory(args, **real, kv_cache_dtype=FP8).activations
                - estimate_memory(args, **real).activations)
        assert grow >= least and (grow > 0) == (device_type == "cuda"), (device_type, grow)


@pytest.mark.parametrize("kv_dtype,smooth", [(None, True), (FP8, False), (FP8, True)])
def test_memory_estimate_counts_every_cache_byte_the_model_allocates(kv_dtype, smooth):
    """estimate_memory's kv_cache is the bytes of every layer's cache buffers (K, V, an fp8
    cache's scales and smoothing means), at a length the key-major rows need no padding for."""
    args = ModelArgs(name="t", n_layers=3, dim=64, n_heads=6, n_kv_heads=2, head_dim=16,
                     intermediate_size=96, vocab_size=128)
    m = Transformer(args)
    B, S = 3, 256
    m.setup_caches(B, S, kv_cache_dtype=kv_dtype, kv_smoothing=smooth)
    held = sum(b.untyped_storage().nbytes() for layer in m.layers
               for b in layer.self_attn.kv_cache.buffers())
    est = estimate_memory(args, tp=1, sp=1, batch=B, prompt_len=0, max_seq_len=S,
                          dtype=torch.float32, device_type="cpu", kv_cache_dtype=kv_dtype,
                          kv_smoothing=smooth)
    assert est.kv_cache == held


def test_model_fp8_cache_prefill_decode_and_synthetic_fill():
    """The model allocates e4m3 caches with scales, chunked prefill writes them (each chunk
    attending to the earlier chunks' fp8 keys), decode steps append, and the logits stay close
    to the float32 cache's; fill_random_cache fills e4m3 values and scales."""
    args = ModelArgs(name="t", n_layers=2, dim=64, n_heads=6, n_kv_heads=2, head_dim=16,
                     intermediate_size=96, vocab_size=128)
    m = Transformer(args)
    load_weights(m, RandomWeights(0), {})
    tok = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(5))
    out = {}
    for kvd in (None, FP8):
        m.setup_caches(2, 32, kvd)
        with torch.no_grad():
            ls = [m.prefill(tok, torch.arange(23), chunk=8)]
            for p in range(23, 27):
                ls.append(m.decode_step(tok[:, p - 23], torch.full((2,), p)))
        out[kvd] = torch.stack(ls)
    cache = m.layers[1].self_attn.kv_cache
    assert cache.k_cache.dtype == FP8 and cache.k_scale.shape == (2, 32, 2)
    assert (cache.k_scale[:, :27] > 0).all() and (cache.k_scale[:, 27:] == 0).all()
    err = (out[FP8] - out[None]).abs().max()
    assert 0 < err < 0.05 * out[None].abs().max(), err
    m.setup_caches(1, 40, FP8)
    m.fill_random_cache(30, seed=1)
    cache = m.layers[0].self_attn.kv_cache
    k = dequantize_kv(cache.k_cache[0, :30], cache.k_scale[0, :30])
    k_std, _ = m.layers[0].self_attn.kv_std(m.layers[0].input_layernorm.weight)
    torch.testing.assert_close(k.std(dim=(0, 2)), k_std, rtol=0.15, atol=0)
    assert (cache.k_scale[0, 30:] == 0).all()


# ------------------------------------------ model quality (transformers' checkpoints, CPU) ---

def _teacher_forced(model, prompt, tokens, kv_dtype):
    """Logits [steps, B, V] float64 of the prefill and the decode steps fed `tokens`."""
    B, P = prompt.shape
    model.setup_caches(B, P + tokens.shape[1], kv_dtype)
    with torch.no_grad():
        out = [model.prefill(prompt, torch.arange(P), chunk=16)]
        for i in range(tokens.shape[1] - 1):
            out.append(model.decode_step(tokens[:, i], torch.full((B,), P + i)))
    return torch.stack(out).double()


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_fp8_cache_against_float32_cache_on_transformers_checkpoints(tmp_path, model_type):
    """transformers' small random Llama / Qwen2 (the checkpoints longctx matches exactly),
    teacher-forced on their greedy tokens: the fp8 cache's logits against the float32 cache's.
    e4m3 keeps 3 mantissa bits to bfloat16's 7 (16x the rounding step), so its logit error is
    held to 2 x 16 x that of the cache rounded to bfloat16; the next-token distribution barely
    moves (KL); and every confident prediction (top-1 margin >= 0.25) is kept. These random
    models' margins are small: their top-1 agreement over all positions is in
    bench/fp8_kv_error.py's table, not a test."""
    from longctx.parallel.build import build_model
    from longctx.weights import HFCheckpoint
    from tests.checkpoint_utils import hf_greedy, save_hf_model

    hf = save_hf_model(tmp_path, model_type=model_type)
    prompt = torch.randint(0, 128, (8, 29), generator=torch.Generator().manual_seed(7))
    tokens, _ = hf_greedy(hf, prompt, 12)
    ckpt = HFCheckpoint(tmp_path)
    model = build_model(ckpt.args(), weights=ckpt, device="cpu", dtype=torch.float32, batch=1,
                        max_seq_len=1)
    want = _teacher_forced(model, prompt, tokens, None)
    fp8 = _teacher_forced(model, prompt, tokens, FP8)
    # The bfloat16 yardstick: the float32 cache's every entry rounded to bfloat16.
    model.make_cache = functools.partial(RoundedKVCache, fmt="bf16")
    bf16 = _teacher_forced(model, prompt, tokens, None)
    err, err_bf16 = (fp8 - want).abs().mean(), (bf16 - want).abs().mean()
    assert 0 < err <= 32 * err_bf16, (err, err_bf16)
    lp, lq = want.log_softmax(-1), fp8.log_softmax(-1)
    assert (lp.exp() * (lp - lq)).sum(-1).mean() < 1e-3
    top2 = want.topk(2, dim=-1).values
    confident = top2[..., 0] - top2[..., 1] >= 0.25
    assert confident.sum() >= 20
    assert (fp8.argmax(-1) == want.argmax(-1))[confident].all()


# -------------------------------------------------------- tp=2 and sp=2 (gloo, CPU) ---------

def _fp8_layouts_match_one_process(rank, world):
    """With an fp8 cache, tp=2 (each rank its KV heads' cache and scales) and sp=2 (each rank its
    positions'; the ring carries the chunk's K/V as the cache holds them) give one process's
    logits after a chunked prefill and decode steps."""
    from longctx.parallel.build import build_model
    from longctx.parallel.mesh import ParallelDims
    from longctx.parallel.sampling import full_logits

    torch.set_num_threads(1)
    args = ModelArgs(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16,
                     intermediate_size=96, vocab_size=128, name="test")
    P, B = 13, 2
    prompt = torch.randint(0, 128, (B, P), generator=torch.Generator().manual_seed(1))

    def build(mesh, smooth=True):
        return build_model(args, weights=RandomWeights(seed=3), device="cpu", dtype=torch.float32,
                           batch=B, max_seq_len=P + 4, mesh=mesh, kv_cache_dtype=FP8,
                           kv_smoothing=smooth)

    ref = build(None)
    assert ref.layers[0].self_attn.kv_cache.k_cache.dtype == FP8
    for tp, sp, chunk, smooth in ((2, 1, 5, True), (1, 2, None, True), (1, 2, 4, True),
                                  (1, 2, None, False)):
        par = build(ParallelDims(tp, sp, world).build_mesh("cpu"), smooth)
        cache = par.layers[0].self_attn.kv_cache
        assert cache.k_cache.dtype == FP8 and cache.k_scale.shape == cache.k_cache.shape[:3]
        assert (cache.k_mean is not None) == smooth
        ref.setup_caches(B, P + 4, FP8, kv_smoothing=smooth)
        # A smoothed cache takes its means from the first prefill chunk. sp's whole-prompt
        # prefill runs the positions the zigzag layout splits evenly (P - P % 2sp) as one chunk
        # and the rest as decode steps, so one process runs that same first chunk.
        ref_chunk = P - P % (2 * sp) if chunk is None and sp > 1 and smooth else chunk
        with torch.no_grad():
            pos = torch.arange(P)
            torch.testing.assert_close(full_logits(par, par.prefill(prompt, pos, chunk=chunk)),
                                       ref.prefill(prompt, pos, chunk=ref_chunk), rtol=1e-5,
                                       atol=1e-5)
            if smooth:  # every rank: the whole first chunk's means of its KV heads
                h = cache.k_mean.shape[1]
                r = torch.distributed.get_rank() if tp > 1 else 0
                want = ref.layers[0].self_attn.kv_cache.v_mean[:, r * h:(r + 1) * h]
                assert torch.equal(cache.v_mean, want)
            for i in range(3):
                tok, p = prompt[:, i], torch.full((B,), P + i)
                torch.testing.assert_close(full_logits(par, par.decode_step(tok, p)),
                                           ref.decode_step(tok, p), rtol=1e-5, atol=1e-5)


def test_fp8_cache_tp2_and_sp2_match_one_process():
    from tests.dist_utils import run_distributed

    run_distributed(_fp8_layouts_match_one_process, 2)
