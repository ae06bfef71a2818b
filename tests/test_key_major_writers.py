"""The fp8 cache writers (ops.store_fp8: a prefill chunk; ops.rope_store_kv: a decode step) into a
V cache stored key-major (longctx.fp8.key_major_v), and into a K cache and scales stored
head-major (longctx.fp8.head_major; the model's layout is both), write what they write into the
usual layout, longctx.fp8.quantize_kv's values and scales bit for bit, and no other byte of
their storage: not the other slots, not the padding past S. The Triton kernels on the `device`
fixture (the interpreter on CPU), the torch code on the CPU.

The interpreter's float32 -> e4m3 conversion is not torch's (it rounds ties away from zero and
drops the carry into the exponent: 126.9 -> 64; triton-lang/triton#8322), so there the values are
checked against the usual layout's only; the scales, and everything on the GPU, bit for bit.
The rule is quantize_kv on the CPU: on CUDA torch divides by a scalar as a product with its
reciprocal, which moves some scales by an ulp."""

import pytest
import torch

from longctx import ops
from longctx.backend import force_triton
from longctx.fp8 import FP8, head_major, is_key_major, key_major_v, quantize_kv
from tests.env import INTERPRET


def _caches(B, S, H, D, device):
    """{layout: (fp8 V cache [B, S, H, D], its scales [B, S, H])}, zero-filled: the usual
    contiguous layout, key-major, head-major (cache and scales), and the model's V (key-major,
    its scales head-major)."""
    km = key_major_v((B, S, H, D), device)
    assert is_key_major(km)
    hm = head_major((B, S, H, D), FP8, device)
    assert not is_key_major(hm) and hm.stride(1) == D
    return {"contiguous": (torch.zeros(B, S, H, D, dtype=FP8, device=device),
                           torch.zeros(B, S, H, device=device)),
            "key_major": (km, torch.zeros(B, S, H, device=device)),
            "head_major": (hm, head_major((B, S, H), torch.float32, device)),
            "model": (key_major_v((B, S, H, D), device),
                      head_major((B, S, H), torch.float32, device))}


def test_head_major_rows_are_whole_lines():
    """head_major keeps the logical shape, each head's positions contiguous and padded to 128
    keys (whole 128-byte lines for an fp8 head_dim of 128 or more, and for the scales)."""
    for S in (1, 37, 128, 1000):
        for shape, dtype in (((2, S, 3, 16), FP8), ((2, S, 3), torch.float32)):
            t = head_major(shape, dtype, "cpu")
            assert t.shape == shape and t.dtype == dtype
            assert (_bits(t) if dtype == FP8 else t).count_nonzero() == 0
            row = shape[3] if len(shape) == 4 else 1  # elements a position of a head
            s_pad = t.stride(2) // row
            assert t.stride(1) == row and s_pad % 128 == 0 and S <= s_pad < S + 128


def test_model_layout_copies_into_the_models_cache_layout():
    """longctx.fp8.model_layout (what the benchmarks time) gives the strides of the model's own
    fp8 cache (longctx.model.KVCache) and the same values, bit for bit."""
    from longctx.fp8 import model_layout
    from longctx.model import KVCache

    for B, S, H, D in ((1, 1, 1, 16), (2, 37, 3, 16), (1, 300, 2, 128)):
        (k8, ks), (v8, vs) = (quantize_kv(torch.randn(B, S, H, D)) for _ in range(2))
        cache = KVCache(B, S, H, D, FP8, torch.device("cpu"))
        ours = model_layout(k8, v8, ks, vs)
        theirs = (cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale)
        for a, b, want in zip(ours, theirs, (k8, v8, ks, vs)):
            assert a.shape == b.shape and a.stride() == b.stride()
            if a.dtype == FP8:
                assert torch.equal(_bits(a), _bits(want))
            else:
                assert torch.equal(a, want)


def test_key_major_v_rows_are_whole_lines():
    """key_major_v pads each (batch, head, column) row to whole 128-byte lines (the decode
    kernel reads 128 keys of a row at a time; rows starting mid-line read slower), keeping the
    logical shape and what check_key_major asks."""
    from longctx.fp8 import check_key_major

    for S in (1, 37, 128, 1000, 1088):
        v = key_major_v((2, S, 3, 16), "cpu")
        assert v.shape == (2, S, 3, 16) and is_key_major(v)
        assert v.stride(-1) % 128 == 0 and S <= v.stride(-1) < S + 128
        check_key_major(v)


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """All of t's storage as uint8, padding included."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _assert_written_only(cache, scale, where, want, want_s):
    """cache[where] holds the e4m3 bits `want` and scale[where] `want_s`; zeroing those, every
    byte of the cache's storage and every scale is zero again (nothing else written)."""
    assert torch.equal(_bits(cache[where]).cpu(), _bits(want).cpu())
    assert torch.equal(scale[where].cpu(), want_s.cpu())
    _bits(cache)[where] = 0
    scale[where] = 0
    assert _storage_bytes(cache).count_nonzero() == 0 and scale.count_nonzero() == 0


def _x(B, S, H, D, device):
    """Random k or v rows [B, S, H, D] float16 over magnitudes 1e-3 to 1e3, one row zero (scale 0,
    zeros)."""
    x = torch.randn(B, S, H, D, device=device) * 10.0 ** torch.randint(-3, 4, (B, S, H, 1),
                                                                       device=device)
    x[0, 0, -1] = 0
    return x.half()


# (B, S, H, D, [(start, end), ...]): the chunks written one after the other. Odd S (37: key-major
# rows padded to 128), chunks at the first and the last slot, H not a power of two, padded D.
STORE_CASES = [
    (2, 37, 3, 32, [(0, 5), (5, 36), (36, 37)]),
    (1, 17, 1, 40, [(0, 17)]),
    (2, 16, 2, 16, [(3, 9)]),  # S a multiple of 16: no padding
]


def _check_store_fp8(B, S, H, D, chunks, device, kernel):
    caches = _caches(B, S, H, D, device)
    x = _x(B, S, H, D, device)
    with force_triton(kernel and device == "cpu"):
        for cache, scale in caches.values():
            for start, end in chunks:
                ops.store_fp8(cache[:, start:end], scale[:, start:end], x[:, start:end])
    written = [s for a, b in chunks for s in range(a, b)]
    want, want_s = quantize_kv(x[:, written].cpu())  # the rule (on the CPU: below)
    c, cs = caches["contiguous"]
    for cache, scale in caches.values():
        assert torch.equal(cache.float(), c.float()) and torch.equal(scale, cs)
    if kernel and INTERPRET:  # its e4m3 rounding (above)
        want = c[:, written].clone()
    for cache, scale in caches.values():
        _assert_written_only(cache, scale, (slice(None), written), want, want_s)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("B,S,H,D,chunks", STORE_CASES)
def test_store_fp8_kernel_into_key_major_v(B, S, H, D, chunks, device, monkeypatch):
    """ops.store_fp8's kernel (the model's prefill and synthetic fill) into a key-major V."""
    monkeypatch.setattr(ops, "quantize_kv", None)  # the torch path would fail: the kernel runs
    _check_store_fp8(B, S, H, D, chunks, device, kernel=True)


@pytest.mark.parametrize("B,S,H,D,chunks", STORE_CASES)
def test_store_fp8_torch_into_key_major_v(B, S, H, D, chunks):
    """ops.store_fp8's torch code (the CPU backend) into a key-major V."""
    _check_store_fp8(B, S, H, D, chunks, "cpu", kernel=False)


def _check_rope_store_kv(B, Hq, Hkv, D, S, steps, device, kernel):
    """Decode steps (slot [B] per step; a slot outside [0, S) writes nothing) into fp8 K and V
    caches of every layout of `_caches` (K contiguous beside a contiguous or key-major V, else
    head-major with head-major scales, as the model's): the same K, V and scales, quantize_kv
    of the rotated k and of v, and nothing else written."""
    T = S + 8
    cos, sin = ops.rope_tables(T, D, 10000.0, torch.device(device))
    v_caches = _caches(B, S, Hkv, D, device)
    k_caches = {name: (torch.zeros(B, S, Hkv, D, dtype=FP8, device=device),
                       torch.zeros(B, S, Hkv, device=device))
                if name in ("contiguous", "key_major") else
                (head_major((B, S, Hkv, D), FP8, device),
                 head_major((B, S, Hkv), torch.float32, device)) for name in v_caches}
    rows = {}  # (b, slot) -> (the rotated k, v) of the last step that wrote it
    for slot in steps:
        slot = torch.tensor(slot, device=device)
        pos = torch.randint(0, T, (B,), device=device)
        qkv = _x(B, 1, Hq + 2 * Hkv, D, device)[:, 0]
        for name in v_caches:
            q, k, v = qkv.clone().split([Hq, Hkv, Hkv], dim=1)
            with force_triton(kernel and device == "cpu"):
                ops.rope_store_kv(q, k, v, cos, sin, pos, k_caches[name][0], v_caches[name][0],
                                  slot, k_caches[name][1], v_caches[name][1])
        for b, s in enumerate(slot.tolist()):
            if 0 <= s < S:
                rows[b, s] = k[b], v[b]
    where = tuple(torch.tensor(w, device=device) for w in zip(*rows))
    (kc, kcs), (vc, vcs) = k_caches["contiguous"], v_caches["contiguous"]
    for name in v_caches:
        assert torch.equal(k_caches[name][0].float(), kc.float())
        assert torch.equal(v_caches[name][0].float(), vc.float())
        assert torch.equal(k_caches[name][1], kcs) and torch.equal(v_caches[name][1], vcs)
    for caches, i in ((k_caches, 0), (v_caches, 1)):
        want, want_s = quantize_kv(torch.stack([r[i] for r in rows.values()]).cpu())
        if kernel and INTERPRET:  # its e4m3 rounding (above)
            want = caches["contiguous"][0][where].clone()
        for cache, scale in caches.values():
            _assert_written_only(cache, scale, where, want, want_s)


# (B, Hq, Hkv, D, S, steps): each step's slots [B]. Slots 0 and S - 1, one written twice, and S
# (past the end: inside a key-major row's padding when S is not a multiple of 16) and -1.
ROPE_STORE_CASES = [
    (2, 6, 3, 32, 37, [[0, 36], [36, 37], [20, -1]]),
    (3, 4, 1, 40, 19, [[18, 0, 19], [5, 0, 9]]),  # half-heads of 20 columns, padded
    (1, 16, 4, 64, 32, [[31], [0]]),
]


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("B,Hq,Hkv,D,S,steps", ROPE_STORE_CASES)
def test_rope_store_kv_kernel_into_key_major_v(B, Hq, Hkv, D, S, steps, device, monkeypatch):
    """ops.rope_store_kv's kernel (the model's decode step: one launch) into a key-major V."""
    monkeypatch.setattr(ops, "store_kv", None)  # the torch path would fail: the kernel runs
    _check_rope_store_kv(B, Hq, Hkv, D, S, steps, device, kernel=True)


@pytest.mark.parametrize("B,Hq,Hkv,D,S,steps", ROPE_STORE_CASES)
def test_rope_store_kv_torch_into_key_major_v(B, Hq, Hkv, D, S, steps):
    """ops.rope_store_kv's torch code (rope_, then store_kv: the CPU backend) into a key-major
    V."""
    steps = [[s if 0 <= s < S else 0 for s in step] for step in steps]  # no range check there
    _check_rope_store_kv(B, Hq, Hkv, D, S, steps, "cpu", kernel=False)
