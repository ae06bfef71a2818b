"""Prefill attention over an fp8 cache whose V is stored key-major (longctx.fp8.key_major_v, the
model's fp8 V, beside its head-major K and scales): the Triton kernel reads it (V_KEY_MAJOR) with
the usual layout's output bit for bit, the API takes it where the kernels read it and refuses it
naming v elsewhere, it never goes to the Gluon Hopper kernel, and it compiles for sm_90 without
spills."""

from __future__ import annotations

import pytest
import torch

import longctx
from longctx.backend import force_triton
from longctx.fp8 import FP8, dequantize_kv, is_key_major, key_major_v, quantize_kv
from longctx.kernels.prefill import check_prefill_args, hopper_kernel_applies
from longctx.reference import reference_attention


def _case(B, Sq, Sk, Hq, Hkv, D, dtype, seed=0):
    """q [B, Sq, Hq, D] in dtype; fp8 K/V [B, Sk, Hkv, D] with their scales (all on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Sk, Hkv, D, generator=g) * (0.2 + 3 * torch.rand(B, Sk, Hkv, 1, generator=g))
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(torch.randn(B, Sk, Hkv, D, generator=g))
    return torch.randn(B, Sq, Hq, D, generator=g).to(dtype), kq, vq, ks, vs


def _key_major(vq: torch.Tensor, s_max: int, device) -> torch.Tensor:
    """vq [B, S, Hkv, D] fp8 written into a key-major cache of s_max >= S positions on `device`,
    returned whole ([B, s_max, Hkv, D]); its first S positions hold vq."""
    B, S, H, D = vq.shape
    v = key_major_v((B, s_max, H, D), device)
    v[:, :S] = vq.to(device)
    return v


# ------------------------------------------------------ the kernel (interpreter / GPU) -------

@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("B,Sq,Sk,s_max,Hq,Hkv,D,q_start", [
    (2, 5, 37, 37, 6, 2, 32, 32),     # a chunk over its history, odd lengths, GQA group 3
    (2, 5, 37, 64, 6, 2, 32, 32),     # the model's view v_cache[:, :end] of a longer cache
    (1, 40, 70, 100, 4, 1, 48, 30),   # head_dim 48 (padded tile), MQA, several key blocks
    (2, 1, 1, 16, 3, 1, 16, 0),       # one key, one query
])
def test_key_major_v_matches_usual_layout(device, causal, B, Sq, Sk, s_max, Hq, Hkv, D, q_start):
    """longctx.attention with a key-major fp8 v (a view of the first Sk positions of a cache of
    s_max) gives the usual layout's O and LSE bit for bit (same tiles, same arithmetic), and
    the usual layout is within twice plain PyTorch's error of the float64 reference."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    q, kq, vq, ks, vs = _case(B, Sq, Sk, Hq, Hkv, D, dtype)
    v_km = _key_major(vq, s_max, device)[:, :Sk]
    assert is_key_major(v_km) and torch.equal(v_km.cpu().float(), vq.float())
    args = dict(causal=causal, q_start=q_start, k_scale=ks.to(device), v_scale=vs.to(device),
                return_lse=True)
    with force_triton(device == "cpu"):
        o, lse = longctx.attention(q.to(device), kq.to(device), vq.to(device), **args)
        o_km, lse_km = longctx.attention(q.to(device), kq.to(device), v_km, **args)
    assert torch.equal(o_km, o) and torch.equal(lse_km, lse)
    k64, v64 = dequantize_kv(kq, ks, torch.float64), dequantize_kv(vq, vs, torch.float64)
    want, _ = reference_attention(q.double(), k64, v64, causal=causal, q_start=q_start)
    plain, _ = reference_attention(q, k64.to(dtype), v64.to(dtype), causal=causal,
                                   q_start=q_start, compute_dtype=dtype)
    err, err_plain = (o.double().cpu() - want).abs().max(), (plain.double() - want).abs().max()
    assert err <= 2 * err_plain + 1e-6, (err, err_plain)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("B,Sq,Sk,s_max,Hq,Hkv,D,q_start", [
    (2, 5, 37, 64, 6, 2, 32, 32),     # the model's view [:, :end] of a longer cache, GQA group 3
    (1, 40, 70, 100, 4, 1, 48, 30),   # head_dim 48 (padded tile), MQA, several key blocks
    (1, 130, 150, 200, 3, 3, 128, 20),  # MHA, the model's head_dim
])
def test_model_fp8_layout_matches_usual_layout(device, B, Sq, Sk, s_max, Hq, Hkv, D, q_start):
    """A chunked prefill over the model's fp8 cache (K and both scales head-major,
    longctx.fp8.head_major; V key-major; views of the first Sk positions of a cache of s_max)
    gives the usual layout's O and LSE bit for bit."""
    from longctx.fp8 import head_major

    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    q, kq, vq, ks, vs = _case(B, Sq, Sk, Hq, Hkv, D, dtype)
    k_hm = head_major((B, s_max, Hkv, D), FP8, device)
    k_hm[:, :Sk] = kq.to(device)
    ks_hm, vs_hm = (head_major((B, s_max, Hkv), torch.float32, device) for _ in range(2))
    ks_hm[:, :Sk], vs_hm[:, :Sk] = ks.to(device), vs.to(device)
    v_km = _key_major(vq, s_max, device)[:, :Sk]
    assert k_hm.stride(1) == D and ks_hm.stride(1) == 1
    with force_triton(device == "cpu"):
        o, lse = longctx.attention(q.to(device), kq.to(device), vq.to(device), causal=True,
                                   q_start=q_start, k_scale=ks.to(device), v_scale=vs.to(device),
                                   return_lse=True)
        o_m, lse_m = longctx.attention(q.to(device), k_hm[:, :Sk], v_km, causal=True,
                                       q_start=q_start, k_scale=ks_hm[:, :Sk],
                                       v_scale=vs_hm[:, :Sk], return_lse=True)
    assert torch.equal(o_m, o) and torch.equal(lse_m, lse)


# ------------------------------------------------------------------- the API (CPU) -----------

def test_api_takes_key_major_fp8_v_on_cpu():
    """The CPU path (the torch reference) reads the strided view as it is."""
    q, kq, vq, ks, vs = _case(2, 5, 37, 6, 2, 32, torch.float32)
    v_km = _key_major(vq, 64, "cpu")[:, :37]
    o = longctx.attention(q, kq, vq, causal=True, q_start=32, k_scale=ks, v_scale=vs)
    o_km = longctx.attention(q, kq, v_km, causal=True, q_start=32, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(o_km, o, rtol=0, atol=0)


def _unpadded_key_major(t: torch.Tensor) -> torch.Tensor:
    """t [B, S, H, D] copied key-major with rows of exactly S keys (no padding to 16)."""
    return t.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


def test_api_refuses_key_major_v_it_cannot_read():
    q, kq, vq, ks, vs = _case(2, 5, 37, 6, 2, 32, torch.float32)
    as_key_major = _unpadded_key_major
    # Not fp8: with an fp8 k, the key-major check names v and the dtype; without, the usual error.
    with pytest.raises(ValueError, match="v must have unit stride in its last .*only an fp8"):
        longctx.attention(q, kq, as_key_major(vq.float()), k_scale=ks, v_scale=vs)
    f = vq.float()
    with pytest.raises(ValueError, match="v must have unit stride in its last"):
        longctx.attention(q, f, as_key_major(f))
    # fp8 but rows of 37 keys: the kernels read 48 (37 rounded up to 16) per row.
    unpadded = as_key_major(vq)
    assert is_key_major(unpadded)
    with pytest.raises(ValueError, match="v is key-major .* multiple of 16 and >= 48"):
        longctx.attention(q, kq, unpadded, causal=True, k_scale=ks, v_scale=vs)
    # q and k keep needing unit stride in head_dim.
    with pytest.raises(ValueError, match="k must have unit stride in its last"):
        longctx.attention(q, as_key_major(kq), _key_major(vq, 37, "cpu"), k_scale=ks,
                          v_scale=vs)
    # The fused merge (a ring step) takes no fp8 k/v, key-major or not.
    o_acc, lse_acc = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
    with pytest.raises(ValueError, match="attention_merge_into takes k and v in q's dtype, not an "
                                         "fp8 cache"):
        longctx.attention_merge_into(o_acc, lse_acc, q, kq, _key_major(vq, 37, "cpu"))


def test_prefill_args_check_key_major_v():
    """flash_attention_fwd's own checks: a key-major v only with fp8 scales, laid out as the
    kernel reads it, and with 16-byte batch / head / head_dim strides."""
    q, kq, vq, ks, vs = _case(2, 5, 37, 6, 2, 32, torch.float16)
    v_km = _key_major(vq, 37, "cpu")
    check_prefill_args(q, kq, v_km, 32, 0, None, None, None, None, ks)
    with pytest.raises(ValueError, match="unit stride in head_dim .*only an fp8 v"):
        check_prefill_args(q, kq, v_km, 32, 0, None, None, None, None, None)
    with pytest.raises(ValueError, match="v is key-major"):
        check_prefill_args(q, kq, _unpadded_key_major(vq), 32, 0, None, None, None, None, ks)


def test_key_major_v_never_takes_the_hopper_kernel():
    """The Gluon kernel takes one half-precision dtype and unit head_dim strides: an fp8 k/v
    (key-major or not) with a bf16 q stays on the Triton kernel, at sizes it would take."""
    q = torch.empty(1, 4096, 16, 128, dtype=torch.bfloat16)
    k = torch.empty(1, 4096, 2, 128, dtype=FP8)
    v = key_major_v(k.shape, "cpu")
    rule = dict(data_ptrs=(0, 0, 0), capability=(9, 0), causal=True, varlen=False,
                config_given=False)
    k16 = torch.empty(k.shape, dtype=torch.bfloat16)
    assert hopper_kernel_applies(dtypes=(q.dtype,) * 3, shapes=(q.shape, k.shape, k.shape),
                                 strides=(q.stride(), k16.stride(), k16.stride()), **rule)
    for vv in (k, v):
        assert not hopper_kernel_applies(dtypes=(q.dtype, k.dtype, vv.dtype),
                                         shapes=(q.shape, k.shape, vv.shape),
                                         strides=(q.stride(), k.stride(), vv.stride()), **rule)


# -------------------------------------------------------------- sm_90 compile (CPU) ----------

def test_key_major_prefill_compiles_for_sm90():
    """Each fp8 launch config (a short chunk, D <= 128, D > 128) with a key-major V view
    compiles for an H100 with V_KEY_MAJOR set, within its shared memory and without spills in
    its loops (as tests/test_compile_targets.py asks of every kernel)."""
    from longctx.kernels.offline import compile_only, disassemble, innermost_loops

    with compile_only((9, 0)) as kernels:
        for sq, sk, d in ((4096, 4096, 128), (64, 300, 128), (512, 4096, 256)):
            q = torch.empty(1, sq, 16, d, dtype=torch.bfloat16)
            k = torch.empty(1, sk, 2, d, dtype=FP8)
            v = key_major_v((1, sk + 100, 2, d), "cpu")[:, :sk]
            s = torch.empty(1, sk, 2)
            longctx.attention(q, k, v, causal=True, q_start=sk - sq, k_scale=s, v_scale=s)
    assert len(kernels) == 3 and {k.name for k in kernels} == {"_attn_fwd_kernel"}
    for k in kernels:
        flag = k.src.fn.arg_names.index("V_KEY_MAJOR")
        assert k.src.constants[(flag,)] is True
        assert k.asm.get("cubin") and k.metadata.shared <= 227 * 1024, k.metadata.shared
        for loop in innermost_loops(disassemble(k.asm["cubin"])):
            spills = [x for x in loop if x.split()[0].split(".")[0] in ("LDL", "STL")]
            assert not spills, f"{k.metadata.num_warps} warps: {spills[:4]}"
