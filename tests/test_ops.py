"""The model's fused small ops (longctx.kernels.fused; the interpreter on CPU) against their torch
versions in longctx.ops."""

import pytest
import torch

from longctx import ops
from longctx.backend import force_triton
from tests.env import DEVICE

HALF = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _cpu(fn, *args):
    """fn's torch path: on CPU copies (CUDA tensors always take the kernels), moved back."""
    out = fn(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    dev = args[0].device
    return tuple(t.to(dev) for t in out) if isinstance(out, tuple) else out.to(dev)


def _both(fn, *args):
    """(the Triton kernel's result, the torch path's result) for the same inputs."""
    want = _cpu(fn, *args)
    with force_triton(not args[0].is_cuda):
        got = fn(*args)
    return got, want


def _tol(dtype):
    # one rounding step of the output dtype: the kernels may round fp32 math differently
    return dict(rtol=1e-6, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("shape,scale", [((3, 200), 3.0), ((2, 1, 1024), 3.0), ((1, 8192), 3.0),
                                         ((4, 96), 3e-3)])  # tiny x: eps matters
def test_rms_norm(dtype, shape, scale, device):
    x = (torch.randn(shape, device=device) * scale).to(dtype)
    w = (torch.rand(shape[-1], device=device) + 0.5).to(dtype)
    got, want = _both(ops.rms_norm, x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))


def _rope_fp64(x, cos, sin, pos):
    c, s = cos.double()[pos][:, :, None], sin.double()[pos][:, :, None]
    x = x.double()
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat((-x2, x1), dim=-1) * s


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("B,S,H,D,decode", [(2, 5, 3, 64, False), (3, 1, 20, 128, True),
                                            (2, 5, 3, 96, False), (3, 1, 5, 40, True),
                                            (1, 3, 2, 24, False)])
def test_rope(dtype, B, S, H, D, decode, device):
    """rope_ rotates in place a strided view (the q and k heads of a fused projection, as the
    model passes them) and leaves the other heads alone, on both paths; head_dims whose halves
    (48, 20, 12) are not powers of two too."""
    cos, sin = ops.rope_tables(64, D, 10000.0, torch.device(device))
    qkv = torch.randn(B, S, H + 2, D, device=device).to(dtype)  # two trailing "v" heads
    if decode:  # one position per sequence, as decode_step passes them
        pos = torch.tensor([0, 17, 63], device=device)[:, None]
    else:       # the same positions for every sequence, as prefill passes them (stride 0)
        pos = torch.arange(10, 10 + S, device=device)[None].expand(B, -1)
    want = _rope_fp64(qkv[:, :, :H], cos, sin, pos)
    results = []
    for triton_path in (False, True):
        x = qkv.clone()
        with force_triton(triton_path and not x.is_cuda):
            out = ops.rope_(x[:, :, :H], cos, sin, pos)
        assert out.data_ptr() == x.data_ptr() and out.dtype == dtype
        assert torch.equal(x[:, :, H:], qkv[:, :, H:])  # the v heads are untouched
        results.append(x[:, :, :H])
    for got in results:
        torch.testing.assert_close(got.double(), want, **_tol(dtype))
    torch.testing.assert_close(results[1].float(), results[0].float(), **_tol(dtype))
    if decode:  # position 0 is the identity
        torch.testing.assert_close(results[1][0], qkv[0, :, :H], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_silu_mul(dtype, device):
    gate_up = (torch.randn(3, 1, 2 * 2500, device=device) * 4).to(dtype)
    got, want = _both(ops.silu_mul, gate_up)
    assert got.dtype == dtype and got.shape == (3, 1, 2500)
    g, u = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(want.double(), g * torch.sigmoid(g) * u, **_tol(dtype))
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("H,D", [(1, 32), (3, 32), (8, 32), (3, 40), (2, 96)])
def test_store_kv(H, D, device):
    B, S_max = 3, 9
    kv = torch.randn(B, 1, 4 + 2 * H, D, device=device, dtype=torch.float16)
    k, v = kv[:, 0, 4:4 + H], kv[:, 0, 4 + H:]  # strided views of a fused projection
    slot = torch.tensor([0, 8, 5], device=device)
    for triton_path in (False, True):
        kc = torch.randn(B, S_max, H, D, device=device, dtype=torch.float16)
        vc = kc.clone() + 1
        before = (kc.clone(), vc.clone())
        with force_triton(triton_path and not kc.is_cuda):
            ops.store_kv(kc, vc, k, v, slot)
        for b in range(B):
            assert torch.equal(kc[b, slot[b]], k[b]) and torch.equal(vc[b, slot[b]], v[b])
            others = torch.arange(S_max, device=device) != slot[b]
            assert torch.equal(kc[b, others], before[0][b, others])
            assert torch.equal(vc[b, others], before[1][b, others])


def _rope_store_case(B, hq, hkv, D, S_max, dtype, device):
    """A decode step's fused projection output qkv [B, hq + 2 hkv, D] and caches [B, S_max, hkv,
    D] of random values."""
    qkv = torch.randn(B, hq + 2 * hkv, D, device=device).to(dtype)
    kc = torch.randn(B, S_max, hkv, D, device=device).to(dtype)
    return qkv, kc, torch.randn_like(kc)


def _rope_store(how, qkv, kc, vc, cos, sin, pos, slot):
    """Copies of (qkv, kc, vc) after a decode step's RoPE and KV store, run `how`: "fused" (the
    rope_store_kv kernel), "separate" (the rope_ and store_kv kernels, as the model ran them
    before: one rope_ over the adjacent q and k heads) or "torch" (rope_store_kv's torch path)."""
    qkv, kc, vc = qkv.clone(), kc.clone(), vc.clone()
    hkv = kc.shape[2]
    q, k, v = qkv.split([qkv.shape[1] - 2 * hkv, hkv, hkv], dim=1)
    with force_triton(how != "torch" and not qkv.is_cuda):
        if how == "separate":
            ops.rope_(qkv[:, None, :-hkv], cos, sin, pos[:, None])
            ops.store_kv(kc, vc, k, v, slot)
        elif how == "torch" and qkv.is_cuda:  # CUDA tensors always take the kernel
            out = _rope_store("torch", *(t.cpu() for t in (qkv, kc, vc, cos, sin, pos, slot)))
            return tuple(t.to(qkv.device) for t in out)
        else:
            ops.rope_store_kv(q, k, v, cos, sin, pos, kc, vc, slot)
    return qkv, kc, vc


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("hq,hkv,D", [(2, 2, 32), (6, 2, 32), (3, 1, 32), (20, 4, 32),
                                      (20, 4, 96), (6, 2, 40), (5, 5, 24)])  # GQA 1, 3, 3, 5
def test_rope_store_kv(dtype, hq, hkv, D, device):
    """The decode step's fused RoPE + KV store gives the bits of the rope_ and store_kv kernels
    and of the torch path (on CUDA torch may round differently: FMA contraction), for ragged
    positions (table rows 0 and last) and slots (0 and S_max - 1); q and k are rotated in
    place, v is left alone, and only each sequence's slot of the caches changes. 20 q heads:
    two blocks of 16. head_dim 96, 40, 24: half-heads of 48, 20, 12 columns, padded."""
    B, S_max, T = 4, 9, 40
    cos, sin = ops.rope_tables(T, D, 10000.0, torch.device(device))
    qkv, kc, vc = _rope_store_case(B, hq, hkv, D, S_max, dtype, device)
    pos = torch.tensor([0, T - 1, 17, 5], device=device)
    slot = torch.tensor([0, S_max - 1, 4, 5], device=device)
    fused = _rope_store("fused", qkv, kc, vc, cos, sin, pos, slot)
    for got, want in zip(fused, _rope_store("separate", qkv, kc, vc, cos, sin, pos, slot)):
        assert torch.equal(got, want)
    torch_path = _rope_store("torch", qkv, kc, vc, cos, sin, pos, slot)
    for got, want in zip(fused, torch_path):
        if device == "cpu":  # the interpreter computes as torch does
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))
    out, kc_out, vc_out = fused
    want = _rope_fp64(qkv[:, None, :hq + hkv], cos, sin, pos[:, None])[:, 0]
    torch.testing.assert_close(out[:, :hq + hkv].double(), want, **_tol(dtype))
    assert torch.equal(out[:, hq + hkv:], qkv[:, hq + hkv:])  # v
    b = torch.arange(B, device=device)
    assert torch.equal(kc_out[b, slot], out[:, hq:hq + hkv])  # the rotated k
    assert torch.equal(vc_out[b, slot], qkv[:, hq + hkv:])
    kc_out[b, slot], vc_out[b, slot] = kc[b, slot], vc[b, slot]
    assert torch.equal(kc_out, kc) and torch.equal(vc_out, vc)  # nothing else written
    assert torch.equal(out[0], qkv[0])  # position 0 is the identity


@pytest.mark.gpu
@pytest.mark.interpreter
def test_rope_store_kv_skips_slots_out_of_range(device):
    """A slot outside [0, S_max) is not written (as store_kv's kernel: the decode that follows
    flags the sequence), while q and k are still rotated; the other sequences are stored."""
    B, hq, hkv, D, S_max = 3, 3, 1, 16, 5
    cos, sin = ops.rope_tables(8, D, 10000.0, torch.device(device))
    qkv, kc, vc = _rope_store_case(B, hq, hkv, D, S_max, torch.float16, device)
    pos, slot = torch.tensor([3, 7, 1], device=device), torch.tensor([-1, 2, S_max], device=device)
    fused = _rope_store("fused", qkv, kc, vc, cos, sin, pos, slot)
    for got, want in zip(fused, _rope_store("separate", qkv, kc, vc, cos, sin, pos, slot)):
        assert torch.equal(got, want)
    out, kc_out, vc_out = fused
    assert not torch.equal(out[:, :hq + hkv], qkv[:, :hq + hkv])  # rotated
    for b in (0, 2):
        assert torch.equal(kc_out[b], kc[b]) and torch.equal(vc_out[b], vc[b])
    assert torch.equal(kc_out[1, 2], out[1, hq:hq + hkv])


def test_rope_store_kv_rejects_bad_shapes():
    cos, sin = ops.rope_tables(8, 16, 10000.0, torch.device("cpu"))
    q, k = torch.zeros(2, 3, 16), torch.zeros(2, 1, 16)
    kc = torch.zeros(2, 5, 1, 16)
    pos = slot = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"q must be \[B, Hq, D\]"):
        ops.rope_store_kv(q[:, :, :8], k, k, cos, sin, pos, kc, kc, slot)
    with pytest.raises(ValueError, match=r"k_cache and v_cache must be \[2, S_max, 1, 16\]"):
        ops.rope_store_kv(q, k, k, cos, sin, pos, kc, torch.zeros(2, 5, 2, 16), slot)
    with pytest.raises(ValueError, match=r"pos and slot must be \[2\]"):
        ops.rope_store_kv(q, k, k, cos, sin, pos[:, None], kc, kc, slot)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,D", [(64, 8, 128), (32, 4, 128), (24, 8, 128), (8, 1, 128),
                                      (32, 32, 96), (16, 4, 192)])
def test_rope_store_kv_gpu_bf16(hq, hkv, D):
    """bf16 on CUDA at model sizes (CodeLlama-34B's heads, its tp=2 and tp=8 shards, GQA 3;
    Phi-3's 32 heads of 96; head_dim 192): the fused kernel gives the bits of the rope_ and
    store_kv kernels, and its q/k error against float64 is at most twice that of the torch
    path in bf16."""
    B, S_max, T = 5, 4096, 8192
    cos, sin = ops.rope_tables(T, D, 1e6, torch.device("cuda"))
    qkv, kc, vc = _rope_store_case(B, hq, hkv, D, S_max, torch.bfloat16, "cuda")
    pos = torch.tensor([0, T - 1, 4095, 123, 7000], device="cuda")
    slot = torch.tensor([0, S_max - 1, 4095, 123, 17], device="cuda")
    fused = _rope_store("fused", qkv, kc, vc, cos, sin, pos, slot)
    for got, want in zip(fused, _rope_store("separate", qkv, kc, vc, cos, sin, pos, slot)):
        assert torch.equal(got, want)
    torch_out = _rope_store("torch", qkv, kc, vc, cos, sin, pos, slot)[0]
    want = _rope_fp64(qkv[:, None, :hq + hkv], cos, sin, pos[:, None])[:, 0]
    err = (fused[0][:, :hq + hkv].double() - want).abs().max()
    err_torch = (torch_out[:, :hq + hkv].double() - want).abs().max()
    assert err <= 2 * err_torch + 1e-6, (err, err_torch)
    b = torch.arange(B, device="cuda")
    assert torch.equal(fused[1][b, slot], fused[0][:, hq:hq + hkv])
    assert torch.equal(fused[2][b, slot], qkv[:, hq + hkv:])


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_rms_norm_with_residual_add(dtype, device):
    x = (torch.randn(2, 3, 300, device=device) * 3).to(dtype)
    add = torch.randn(2, 3, 300, device=device).to(dtype)
    w = (torch.rand(300, device=device) + 0.5).to(dtype)
    (s_got, y_got), (s_want, y_want) = _both(ops.rms_norm, x, w, 1e-5, add)
    assert torch.equal(s_got, x + add) and torch.equal(s_want, x + add)
    torch.testing.assert_close(y_want, _cpu(ops.rms_norm, x + add, w, 1e-5), rtol=0, atol=0)
    torch.testing.assert_close(y_got.float(), y_want.float(), **_tol(dtype))


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("N,K", [(37, 100), (130, 700), (64, 1536)])
def test_linear_one_row_gemv(N, K, device):
    """The batch-1 GEMV against float64, within 2x torch's error in the same dtype (odd N and K:
    masked rows and a K tail)."""
    w = torch.randn(N, K, device=device).to(torch.float16)
    x = torch.randn(1, 1, K, device=device).to(torch.float16)
    want = x.double() @ w.double().T
    with force_triton(not x.is_cuda):
        got = ops.linear(x, w)
    assert got.shape == (1, 1, N) and got.dtype == torch.float16
    plain = torch.nn.functional.linear(x.float(), w.float()).half()  # fp32 accumulate, one rounding
    err, err_plain = (got.double() - want).abs().max(), (plain.double() - want).abs().max()
    assert err <= 2 * err_plain + 1e-6, (err, err_plain)


GEMV_CONFIGS = [(4, 2048, 8), (4, 1024, 4), (2, 1024, 4), (4, 512, 2)]


def test_gemv_rule_picks_tested_configs():
    """For K from 1024 up (multiples of 8, as head_dim and the presets' sizes are), the rule
    picks only configs that test_gemv_configs checks."""
    from longctx.kernels.gemv import gemv_config

    picked = {gemv_config(N, K) for N in (640, 4096, 32000) for K in range(1024, 65537, 8)}
    assert picked <= set(GEMV_CONFIGS), picked - set(GEMV_CONFIGS)


@pytest.mark.parametrize("shape, config", [
    ((8192, 2048), (4, 2048, 8)), ((4096, 2048), (4, 2048, 8)),  # o: CodeLlama tp=4, Llama-8B tp=2
    ((8192, 5504), (4, 512, 2)), ((5120, 1280), (4, 512, 2)),  # CodeLlama down, Qwen-32B o: tp=4
    ((5120, 2560), (4, 512, 2)), ((3584, 1792), (4, 512, 2)),  # o: Qwen-32B tp=2, Qwen-7B tp=2
    ((5120, 6912), (4, 1024, 4)), ((4096, 3584), (4, 1024, 4)),  # down: Qwen-32B, Llama-8B tp=4
    ((8192, 11008), (4, 1024, 4)), ((8192, 22016), (4, 1024, 4)),  # CodeLlama down tp=2, tp=1
])
def test_gemv_rule_at_measured_shapes(shape, config):
    """The rule picks, for each weight whose configs were compared in its tp model (gemv_config's
    docstring, bench/results/model/gemv-rules-*.txt), the config that measured fastest there."""
    from longctx.kernels.gemv import gemv_config

    assert gemv_config(*shape) == config


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("K", [8192, 5000, 2048])
@pytest.mark.parametrize("config", GEMV_CONFIGS)
def test_gemv_configs(K, config, device):
    """Each GEMV launch config the rule picks or a sweep tries (passed here for a small N)
    against float64, within 2x torch's error: K a multiple of the step, K with a masked tail,
    and K = 2048 (one 2048-wide step: no second tile before the PDL wait)."""
    from longctx.kernels.gemv import gemv

    w = torch.randn(37, K, device=device).to(torch.float16)
    x = torch.randn(1, K, device=device).to(torch.float16)
    want = x.double() @ w.double().T
    got = gemv(x, w, config=config)
    plain = torch.nn.functional.linear(x.float(), w.float()).half()
    err, err_plain = (got.double() - want).abs().max(), (plain.double() - want).abs().max()
    assert err <= 2 * err_plain + 1e-6, (err, err_plain)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("N,K", [(37, 100), (130, 2048)])
def test_linear_one_row_gemv_with_bias(N, K, dtype, device):
    """The batch-1 GEMV with a bias (q/k/v of Qwen2) against float64, within 2x the error of
    torch's linear in the same dtype (fp32 sums plus the bias, one rounding)."""
    w = torch.randn(N, K, device=device).to(dtype)
    b = (torch.randn(N, device=device) * 4).to(dtype)  # comparable to the products' spread
    x = torch.randn(1, 1, K, device=device).to(dtype)
    want = x.double() @ w.double().T + b.double()
    with force_triton(not x.is_cuda):
        got = ops.linear(x, w, b)
    assert got.shape == (1, 1, N) and got.dtype == dtype
    plain = torch.nn.functional.linear(x.float(), w.float(), b.float()).to(dtype)
    err, err_plain = (got.double() - want).abs().max(), (plain.double() - want).abs().max()
    assert err <= 2 * err_plain + 1e-6, (err, err_plain)
    from longctx.kernels.gemv import gemv

    with pytest.raises(ValueError, match=rf"bias must be contiguous \[{N}\]"):
        gemv(x, w, bias=b[:5])


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("M,N,K,bias", [(2, 37, 100, False), (8, 130, 256, True),
                                        (16, 64, 200, False), (5, 33, 1536, True)])
@pytest.mark.parametrize("config", [None, (64, 128, 4, 4), (64, 256, 4, 4)],
                         ids=["rule", "128-wide", "64-row"])
def test_skinny_gemm(M, N, K, bias, config, dtype, device):
    """The decode projections at batch 2-16 (kernels/gemv.py skinny_gemm) against float64,
    within 2x torch's error in the same dtype (odd N and K: masked rows, a K tail; M < 16:
    padded rows), with the rule's config for these shapes (32-row tiles) and the ones it takes
    for more outputs."""
    from longctx.kernels.gemv import skinny_gemm

    w = torch.randn(N, K, device=device).to(dtype)
    x = torch.randn(M, 1, K, device=device).to(dtype)
    b = (torch.randn(N, device=device) * 4).to(dtype) if bias else None
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    got = skinny_gemm(x, w, b, config=config)
    assert got.shape == (M, 1, N) and got.dtype == dtype
    plain = torch.nn.functional.linear(x.float(), w.float(), b.float() if bias else None).to(dtype)
    err, err_plain = (got.double() - want).abs().max(), (plain.double() - want).abs().max()
    assert err <= 2 * err_plain + 1e-6, (err, err_plain)
    with pytest.raises(ValueError, match="skinny_gemm takes 1-16 rows"):
        skinny_gemm(torch.zeros(17, K, device=device, dtype=dtype), w)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("I,K", [(37, 100), (65, 700), (32, 1536)])
def test_linear_silu_mul_gated_gemv(I, K, device):
    """The gated batch-1 GEMV (silu(gate) * up in its epilogue) against float64, within 2x the
    error of the unfused ops in the same dtype (odd I: masked outputs of the last program)."""
    w = (torch.randn(2 * I, K, device=device) * K**-0.5).to(torch.float16)
    x = torch.randn(1, 1, K, device=device).to(torch.float16)
    g, u = (x.double() @ w.double().T).chunk(2, dim=-1)
    want = torch.nn.functional.silu(g) * u
    with force_triton(not x.is_cuda):
        got = ops.linear_silu_mul(x, w)
    assert got.shape == (1, 1, I) and got.dtype == torch.float16
    plain = ops.silu_mul(torch.nn.functional.linear(x.float(), w.float()).half())
    err, err_plain = (got.double() - want).abs().max(), (plain.double() - want).abs().max()
    assert err <= 2 * err_plain + 1e-6, (err, err_plain)


def test_host_cdiv_and_next_power_of_2_match_triton():
    # The launch wrappers use plain-Python versions (triton's are slow constexpr functions).
    import triton

    from longctx.kernels.utils import cdiv, next_power_of_2

    for n in range(0, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert next_power_of_2(2**40 + 1) == 2**41
