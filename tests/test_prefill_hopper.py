"""The Hopper prefill path: the dispatch rule (`hopper_kernel_applies`, on any machine) and the
Gluon kernel (kernels/prefill_hopper.py, on an sm_90 GPU only) against the float64 reference.

GPU tests import the Gluon module inside the test: it must never be imported on a CPU or under
the interpreter. Errors are judged as in tests/test_prefill.py (at most 2x the error of a plain
PyTorch implementation in the same dtype); the fused merge is compared with the Triton kernel's
(LONGCTX_PREFILL_KERNEL=triton).
"""

from __future__ import annotations

import contextlib
import itertools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import triton
import triton.language as tl

import longctx
import longctx.kernels.prefill as P
from longctx.backend import force_triton
from longctx.kernels.prefill import hopper_kernel_applies
from longctx.kernels.prefill_tiles import (
    _clamp_delta,
    _key_tiles,
    _row_key_limit,
    _row_lse,
    _softmax_step,
    _softmax_step_masked,
)
from longctx.kernels.utils import FP_FUSION
from longctx.reference import reference_attention
from tests.env import DEVICE
from tests.test_prefill import check, rand, ref_seq

BF16, FP16 = torch.bfloat16, torch.float16
HALF = pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_gpu = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 (Hopper) GPU")


# --------------------------------------------------------------------------- #
# The dispatch rule (CPU)
# --------------------------------------------------------------------------- #
def contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


def call(q=(2, 8192, 16, 128), k=(2, 8192, 2, 128), **changes) -> bool:
    """hopper_kernel_applies for a dense bf16 call on an sm_90 GPU with q / k (= v) shapes,
    contiguous and aligned unless `changes` says otherwise."""
    kw = dict(dtypes=(BF16, BF16, BF16), shapes=(q, k, k),
              strides=(contiguous(q), contiguous(k), contiguous(k)), data_ptrs=(1 << 20,) * 3,
              capability=(9, 0), causal=False, varlen=False, config_given=False)
    kw.update(changes)
    return hopper_kernel_applies(**kw)


def varlen_call(total_q: int, total_k: int, num_seqs: int, hq: int = 16, hkv: int = 2,
                **changes) -> bool:
    """`call` for a varlen batch: q [total_q, hq, 128], k / v [total_k, hkv, 128]."""
    q, k = (total_q, hq, 128), (total_k, hkv, 128)
    return call(q, k, **dict(dict(varlen=True, num_seqs=num_seqs,
                                   strides=(contiguous(q), contiguous(k), contiguous(k))),
                             **changes))


PACKED = contiguous((2, 8192, 20, 128))  # a qkv projection: q = heads 0..15, k 16..17, v 18..19
BHSD = (8192 * 16 * 128, 128, 8192 * 128, 1)  # q of [B, H, S, D] memory, transposed to [B, S, H, D]
KV = contiguous((2, 8192, 2, 128))


def q_strides(q: tuple[int, ...]) -> dict:
    """`call` changes: q with these strides, k and v contiguous."""
    return dict(strides=(q, KV, KV))


ACCEPTED = [
    pytest.param({}, id="dense-no-mask"),
    pytest.param(dict(causal=True), id="causal-diagonal-8192-rows"),
    pytest.param(dict(dtypes=(FP16,) * 3), id="fp16"),
    pytest.param(dict(q=(2, 2048, 16, 128), k=(2, 640, 2, 128)), id="no-mask-sq-ne-sk"),
    pytest.param(dict(q=(2, 2048, 16, 128), k=(2, 128, 2, 128)), id="no-mask-one-kv-tile"),
    pytest.param(dict(q=(1, 4096, 16, 128), k=(1, 4096, 2, 128)), id="no-mask-512-programs"),
    pytest.param(dict(q=(1, 3969, 16, 128), k=(1, 1, 2, 128)), id="no-mask-ragged-512-programs"),
    pytest.param(dict(causal=True, q=(1, 2048, 16, 128), k=(1, 2048, 2, 128)),
                 id="causal-2048-rows"),
    pytest.param(dict(causal=True, q=(1, 12000, 24, 128), k=(1, 12000, 8, 128)),
                 id="causal-12000-rows-24-8-heads"),
    pytest.param(dict(causal=True, q=(1, 65537, 16, 128), k=(1, 65537, 2, 128)),
                 id="causal-65537-rows"),
    pytest.param(dict(q=(3, 1000, 32, 128), k=(3, 1001, 32, 128)), id="no-mask-ragged-batch-3"),
    pytest.param(dict(causal=True, q=(1, 2048, 16, 128), k=(1, 30000, 2, 128)),
                 id="causal-chunked-prefill-sq-ne-sk"),
    pytest.param(dict(q=(2, 8192, 12, 128), k=(2, 8192, 4, 128)), id="gqa-group-3-12-4"),
    pytest.param(dict(q=(2, 8192, 8, 128), k=(2, 8192, 1, 128)), id="mqa-group-8"),
    pytest.param(dict(q=(2, 8192, 16, 64), k=(2, 8192, 2, 64)), id="head-dim-64"),
    pytest.param(dict(q=(2, 8192, 16, 256), k=(2, 8192, 2, 256)), id="head-dim-256"),
    # not powers of two: padded to the tiles of 64, 128, 256
    pytest.param(dict(q=(2, 8192, 32, 96), k=(2, 8192, 32, 96)), id="head-dim-96"),
    pytest.param(dict(q=(2, 8192, 16, 192), k=(2, 8192, 2, 192)), id="head-dim-192"),
    pytest.param(dict(q=(2, 8192, 16, 80), k=(2, 8192, 2, 80)), id="head-dim-80"),
    pytest.param(dict(q=(2, 8192, 16, 40), k=(2, 8192, 2, 40)), id="head-dim-40"),
    pytest.param(dict(causal=True, q=(1, 4096, 16, 248), k=(1, 4096, 2, 248)),
                 id="head-dim-248-causal"),
    pytest.param(dict(q=(1, 8192, 16, 128), k=(1, 8192, 2, 128),
                      strides=((3 << 30, 2048, 128, 1), (5, 256, 128, 1), (7, 256, 128, 1))),
                 id="batch-1-any-batch-stride"),
    pytest.param(dict(strides=(PACKED,) * 3,
                      data_ptrs=(1 << 20, (1 << 20) + 16 * 256, (1 << 20) + 18 * 256)),
                 id="packed-qkv-views"),
    # not a 2-D [B * S, H * D] tensor, but every (sequence, head) is a TMA tensor: the kernel's
    # device-side descriptors
    pytest.param(q_strides(BHSD), id="bhsd-memory-device-descriptors"),
    pytest.param(q_strides((2 * 8192 * 2048, 2048, 128, 1)), id="batch-stride-not-sq-rows"),
]

DECLINED = [
    pytest.param(dict(capability=(8, 0)), id="not-hopper-sm80"),
    pytest.param(dict(capability=(10, 0)), id="not-hopper-sm100"),
    pytest.param(dict(capability=None), id="not-cuda"),
    pytest.param(dict(config_given=True), id="config-override"),
    pytest.param(dict(dtypes=(torch.float32,) * 3), id="fp32"),
    pytest.param(dict(dtypes=(BF16, FP16, FP16)), id="mixed-dtypes"),
    pytest.param(dict(q=(2, 8192, 16, 32), k=(2, 8192, 2, 32)), id="head-dim-32"),
    pytest.param(dict(q=(2, 8192, 16, 24), k=(2, 8192, 2, 24)), id="head-dim-24-tile-32"),
    pytest.param(dict(q=(2, 8192, 16, 100), k=(2, 8192, 2, 100)), id="head-dim-100-not-x8"),
    pytest.param(dict(q=(0, 8192, 16, 128), k=(0, 8192, 2, 128)), id="empty-batch"),
    pytest.param(dict(k=(2, 0, 2, 128)), id="no-keys"),
    pytest.param(dict(q=(2, 0, 16, 128)), id="no-queries"),
    pytest.param(q_strides((8192 * 16 * 256, 16 * 256, 256, 2)), id="head-dim-stride-not-1"),
    pytest.param(dict(data_ptrs=((1 << 20) + 2, 1 << 20, 1 << 20)), id="q-not-16-byte-aligned"),
    pytest.param(q_strides((8192 * 2052, 2052, 128, 1)), id="row-stride-not-16-bytes"),
    pytest.param(q_strides((8192 * 16 * 132, 16 * 132, 132, 1)), id="head-stride-not-16-bytes"),
    pytest.param(dict(q=(1, 8192, 16, 128), k=(1, 8192, 2, 128),
                      strides=(contiguous((1, 8192, 16, 128)), (0, 0, 128, 1), (0, 0, 128, 1))),
                 id="k-rows-overlap-expanded"),
    pytest.param(dict(causal=True, q=(2, 1920, 16, 128), k=(2, 1920, 2, 128)),
                 id="causal-below-2048-rows-stays-on-triton"),
    pytest.param(dict(causal=True, q=(1, 1000, 16, 128), k=(1, 30000, 2, 128)),
                 id="causal-chunk-below-2048-rows-stays-on-triton"),
    pytest.param(dict(q=(1, 2048, 16, 128), k=(1, 2048, 2, 128)),
                 id="no-mask-256-programs-stays-on-triton"),
    pytest.param(dict(q=(1, 3968, 16, 128), k=(1, 1, 2, 128)), id="no-mask-496-programs"),
]


@pytest.mark.parametrize("changes", ACCEPTED)
def test_hopper_kernel_applies_accepts(changes: dict) -> None:
    assert call(**changes)


@pytest.mark.parametrize("changes", DECLINED)
def test_hopper_kernel_applies_declines(changes: dict) -> None:
    assert not call(**changes)


@pytest.mark.parametrize("total_q,num_seqs,causal,hq,expected", [
    pytest.param(65536, 8, True, 16, True, id="causal-8-seqs-64k"),
    pytest.param(65536, 8, False, 16, True, id="full-8-seqs-64k"),
    pytest.param(16384, 8, True, 16, True, id="causal-mean-2048-rows"),
    pytest.param(16383, 8, True, 16, False, id="causal-mean-below-2048-rows"),
    pytest.param(4096, 8, False, 16, True, id="full-512-programs"),
    pytest.param(4095, 8, False, 15, False, id="full-below-512-programs"),
    pytest.param(65536, 0, False, 16, False, id="no-sequences"),
])
def test_hopper_kernel_applies_varlen(total_q: int, num_seqs: int, causal: bool, hq: int,
                                      expected: bool) -> None:
    """Varlen: the work rules on the mean sequence (causal) and on Hq * cdiv(total_q, 128)
    programs (no mask)."""
    assert varlen_call(total_q, total_q, num_seqs, hq=hq, hkv=1, causal=causal) == expected


def test_hopper_kernel_applies_varlen_layout() -> None:
    """Varlen needs every (sequence, head) TMA-addressable: packed qkv views pass, a misaligned
    base, head stride or row stride does not."""
    packed = (20 * 128, 128, 1)  # [T, 20 heads, 128]: q = heads 0..15, k 16..17, v 18..19
    ptrs = (1 << 20, (1 << 20) + 16 * 256, (1 << 20) + 18 * 256)
    assert varlen_call(65536, 65536, 8, strides=(packed,) * 3, data_ptrs=ptrs)
    assert not varlen_call(65536, 65536, 8, strides=(packed,) * 3,
                           data_ptrs=(ptrs[0] + 8, *ptrs[1:]))
    kv = contiguous((65536, 2, 128))
    assert not varlen_call(65536, 65536, 8, strides=((16 * 132, 132, 1), kv, kv))
    assert not varlen_call(65536, 65536, 8, strides=((16 * 128 + 4, 128, 1), kv, kv))
    q96, kv96 = (65536, 16, 96), (65536, 2, 96)  # 192-byte rows: padded tiles, TMA-addressable
    assert call(q96, kv96, varlen=True, num_seqs=8,
                strides=(contiguous(q96), contiguous(kv96), contiguous(kv96)))


def test_prefill_kernel_env() -> None:
    """LONGCTX_PREFILL_KERNEL: unset / "" / "auto" allow the Hopper kernel, "triton" forbids it,
    anything else is an error naming the variable; `prefill_kernel` switches it for a block and
    puts the previous choice back, also when the block raises."""
    for value, choice in ((None, "auto"), ("", "auto"), ("auto", "auto"), ("triton", "triton")):
        assert P._parse_prefill_kernel(value) == choice
    with pytest.raises(ValueError, match="LONGCTX_PREFILL_KERNEL"):
        P._parse_prefill_kernel("gluon")
    before = P._prefill_choice
    with P.prefill_kernel("triton"):
        assert P._prefill_choice == "triton"
        with pytest.raises(RuntimeError), P.prefill_kernel("auto"):
            assert P._prefill_choice == "auto"
            raise RuntimeError
        assert P._prefill_choice == "triton"
    assert P._prefill_choice == before
    with pytest.raises(ValueError, match="LONGCTX_PREFILL_KERNEL"), P.prefill_kernel("gluon"):
        pass
    assert P._prefill_choice == before


def test_hopper_module_without_gluon_means_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Triton without Gluon: no Hopper module, the Triton kernel runs."""
    # None in sys.modules: importing the module raises ImportError
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon", None)
    P._hopper_module.cache_clear()
    try:
        assert P._hopper_module() is None
    finally:
        P._hopper_module.cache_clear()


def test_hopper_module_error_is_not_a_silent_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """With Gluon present, an import error inside kernels/prefill_hopper.py raises instead of
    quietly sending every call to the Triton kernel."""
    pytest.importorskip("triton.experimental.gluon")
    import longctx.kernels

    monkeypatch.setitem(sys.modules, "longctx.kernels.prefill_hopper", None)
    # Imported already by an earlier test in this process, the module is also an attribute of
    # the package, which `from longctx.kernels import prefill_hopper` would take as it is.
    monkeypatch.delattr(longctx.kernels, "prefill_hopper", raising=False)
    P._hopper_module.cache_clear()
    try:
        with pytest.raises(ImportError):
            P._hopper_module()
    finally:
        P._hopper_module.cache_clear()


def test_hopper_module_imports() -> None:
    """kernels/prefill_hopper.py imports (its names from kernels/prefill.py exist) wherever Gluon
    does, GPU or not."""
    pytest.importorskip("triton.experimental.gluon")
    # In a child process: this one's tests check that the interpreter path never imports it.
    run = subprocess.run([sys.executable, "-c", "import longctx.kernels.prefill_hopper"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


@pytest.mark.interpreter
def test_interpreter_never_imports_the_gluon_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls that the Hopper kernel would take on an sm_90 GPU, on the Triton kernels under the
    interpreter: the dispatch never tries to import the Gluon module."""
    def fail():
        raise AssertionError("kernels/prefill_hopper.py must not be imported here")

    monkeypatch.setattr(P, "_hopper_module", fail)
    q, k, v = (rand(1, 128, h, 128, dtype=FP16) for h in (2, 1, 1))
    o_acc = torch.zeros(1, 128, 2, 128)
    lse_acc = torch.full((1, 128, 2), float("-inf"))
    with force_triton():
        longctx.attention(q, k, v)
        longctx.attention_merge_into(o_acc, lse_acc, q, k, v)
    assert "longctx.kernels.prefill_hopper" not in sys.modules


# --------------------------------------------------------------------------- #
# The Gluon kernel's masking rule (kernels/prefill_tiles.py), any machine
# --------------------------------------------------------------------------- #
@triton.jit
def _tile_walk_kernel(Q, K, V, O, LSE, SEQLEN_Q, SEQLEN_K, Q_START, K_START, qk_scale,
                      D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      CAUSAL: tl.constexpr):
    """One query tile of the Gluon consumer's walk, with its tile helpers: key tiles
    [0, n_tiles), S_0 masked, then unmasked below n_full and masked from there. q [Sq_pad, D],
    k/v [Sk_pad, D] (zero rows past the lengths, as TMA fills them), fp32; o [Sq_pad, D],
    lse [Sq_pad]."""
    m0 = tl.program_id(0) * BLOCK_M
    delta = _clamp_delta(Q_START, K_START) if CAUSAL else 0
    n_full, n_tiles = _key_tiles(m0, SEQLEN_Q, SEQLEN_K, delta, CAUSAL, BLOCK_M, BLOCK_N)
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    row_lim = _row_key_limit(rows, SEQLEN_K, delta, CAUSAL)
    q = tl.load(Q + rows[:, None] * D + dims[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    t = 0
    while t < n_tiles:
        keys = t * BLOCK_N + cols
        k = tl.load(K + keys[:, None] * D + dims[None, :])
        v = tl.load(V + keys[:, None] * D + dims[None, :])
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        if t == 0 or t >= n_full:
            p, alpha, m_i, l_i = _softmax_step_masked(s, cols, row_lim - t * BLOCK_N, m_i, l_i,
                                                      qk_scale)
        else:
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        t += 1
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + rows[:, None] * D + dims[None, :], acc)
    tl.store(LSE + rows, _row_lse(m_i, l_i))


def tile_walk(q, k, v, causal: bool, q_start: int, k_start: int, block_m: int, block_n: int):
    """The walk over one sequence: q [Sq, D], k/v [Sk, D] float32 (CPU) -> o [Sq, D], lse [Sq]."""
    sq, d = q.shape
    sk = k.shape[0]
    pad = lambda x, n: torch.cat([x, x.new_zeros(n - x.shape[0], d)])  # noqa: E731
    sq_pad = -(-max(sq, 1) // block_m) * block_m
    sk_pad = -(-max(sk, 1) // block_n) * block_n + block_n  # room for a tile past n_tiles
    qp, kp, vp = pad(q, sq_pad), pad(k, sk_pad), pad(v, sk_pad)
    o = torch.full((sq_pad, d), float("nan"))
    lse = torch.full((sq_pad,), float("nan"))
    _tile_walk_kernel[(sq_pad // block_m,)](qp, kp, vp, o, lse, sq, sk, q_start, k_start,
                                           d ** -0.5 * 1.4426950408889634, D=d, BLOCK_M=block_m,
                                           BLOCK_N=block_n, CAUSAL=causal, **FP_FUSION)
    return o[:sq], lse[:sq]


@pytest.mark.interpreter
@pytest.mark.parametrize("sq,sk,q_start,k_start,causal", [
    pytest.param(1, 1, 0, 0, True, id="one-row"),
    pytest.param(37, 37, 0, 0, True, id="square-ragged"),
    pytest.param(64, 64, 0, 0, True, id="square-aligned"),
    pytest.param(37, 37, 0, 0, False, id="full-ragged"),
    pytest.param(20, 5, 0, 0, False, id="full-fewer-keys-than-a-tile"),
    pytest.param(40, 100, 60, 0, True, id="chunked-prefill-last-chunk"),
    pytest.param(33, 90, 57, 0, True, id="chunked-band-spans-tiles"),
    pytest.param(40, 70, 0, 30, True, id="q-before-k-empty-rows"),
    pytest.param(20, 30, 0, 100, True, id="every-row-empty"),
    pytest.param(20, 30, 1 << 40, 0, True, id="huge-positive-offset"),
    pytest.param(20, 30, 0, 1 << 40, True, id="huge-negative-offset"),
    pytest.param(25, 0, 0, 0, False, id="no-keys"),
])
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32)],
                         ids=["16x16", "32x16", "16x32"])
def test_tile_walk_matches_reference(sq: int, sk: int, q_start: int, k_start: int, causal: bool,
                                     block_m: int, block_n: int) -> None:
    """The key tiles the Gluon kernel visits, which of them it masks, the masked step's -inf
    guard and the empty-row epilogue: against the float64 reference, any lengths and offsets."""
    d = 16
    q, k, v = torch.randn(sq, 1, d), torch.randn(sk, 1, d), torch.randn(sk, 1, d)
    o, lse = tile_walk(q[:, 0], k[:, 0], v[:, 0], causal, q_start, k_start, block_m, block_n)
    o_ref, lse_ref = ref_seq(q, k, v, d ** -0.5, causal, q_start, k_start)
    check(o[:, None], lse[:, None], o_ref, lse_ref, torch.float32)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_key_tiles_bounds(causal: bool) -> None:
    """_key_tiles' rule in plain numbers, for every query tile of awkward lengths and every
    offset from -40 to 40: n_tiles is the fewest key tiles that hold every key a real row of
    the tile sees (0 when none sees any), n_full the most leading tiles that every real row
    sees entirely."""
    bm, bn = 16, 8
    for sq, sk in ((37, 45), (1, 9), (20, 0), (16, 16), (33, 8), (40, 100)):
        for delta in range(-40, 41) if causal else (0,):
            for m0 in range(0, sq + bm, bm):
                rows = range(m0, min(m0 + bm, sq))
                seen = [min(sk, max(0, r + delta + 1)) if causal else sk for r in rows]
                want = (min(seen, default=0) // bn, -(-max(seen, default=0) // bn))
                got = tile_bounds(m0, sq, sk, delta, causal, bm, bn)
                assert got == want, (sq, sk, delta, m0, got, want)


@triton.jit
def _tile_bounds_kernel(OUT, m0, seqlen_q, seqlen_k, delta, CAUSAL: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    n_full, n_tiles = _key_tiles(m0, seqlen_q, seqlen_k, delta, CAUSAL, BLOCK_M, BLOCK_N)
    tl.store(OUT, n_full)
    tl.store(OUT + 1, n_tiles)


def tile_bounds(m0, sq, sk, delta, causal, bm, bn) -> tuple[int, int]:
    out = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    _tile_bounds_kernel[(1,)](out, m0, sq, sk, delta, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn,
                              **FP_FUSION)
    return int(out[0]), int(out[1])


# --------------------------------------------------------------------------- #
# The Gluon kernel (sm_90 GPU)
# --------------------------------------------------------------------------- #
@contextlib.contextmanager
def gluon_counter() -> Iterator[list[str]]:
    """Records every launch of the Gluon kernel that the dispatch makes (HopperLaunch's fast and
    generic launch methods, wrapped on the class)."""
    from longctx.kernels import prefill_hopper

    cls, calls = prefill_hopper.HopperLaunch, []
    real = {name: getattr(cls, name) for name in ("__call__", "generic")}

    def wrap(name):
        def counted(*args, **kwargs):
            calls.append(name)
            return real[name](*args, **kwargs)
        return counted

    for name in real:
        setattr(cls, name, wrap(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(cls, name, fn)


def hopper_fwd(*args, **kwargs):
    from longctx.kernels.prefill_hopper import hopper_attention_fwd

    return hopper_attention_fwd(*args, **kwargs)


def ref_gpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
            q_start: int, k_start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's float64 reference and plain PyTorch half-precision output, computed on the
    GPU in blocks of query rows (the scores of 65537 x 65537 rows do not fit at once):
    q [Sq, Hq, D], k/v [Sk, Hkv, D] -> o_ref [Sq, Hq, D], lse_ref [Sq, Hq] (float64),
    o_half [Sq, Hq, D] (q's dtype), on the CPU."""
    sq, hq, _ = q.shape
    block = max(64, (1 << 27) // max(1, k.shape[0] * hq))
    parts = []
    for a in range(0, sq, block):
        kw = dict(causal=causal, softmax_scale=scale, q_start=q_start + a, k_start=k_start)
        qb = q[a:a + block][None]
        o, lse = reference_attention(qb, k[None], v[None], compute_dtype=torch.float64, **kw)
        o_half, _ = reference_attention(qb, k[None], v[None], compute_dtype=q.dtype, **kw)
        parts.append((o[0].cpu(), lse[0].cpu(), o_half[0].cpu()))
        del o, lse, o_half
    o_ref, lse_ref, o_half = (torch.cat(x) for x in zip(*parts))
    return o_ref, lse_ref, o_half


def check_seq(o, lse, q, k, v, scale, causal, q_start, k_start) -> None:
    """One sequence of the kernel's output (o [Sq, Hq, D], lse [Sq, Hq]) against the float64
    reference: tests/test_prefill.py's rule (at most 2x the plain PyTorch error)."""
    if q.shape[0] == 0:
        return
    o_ref, lse_ref, o_half = ref_gpu(q, k, v, scale, causal, q_start, k_start)
    check(o, lse, o_ref, lse_ref, q.dtype, o_half)


def per_seq(x: int | list[int], i: int) -> int:
    return x[i] if isinstance(x, list) else x


def as_offset(x: int | list[int], dtype: torch.dtype) -> int | torch.Tensor:
    return torch.tensor(x, dtype=dtype, device="cuda") if isinstance(x, list) else x


def run(lens_q: list[int], lens_k: list[int], hq: int, hkv: int, *, causal: bool,
        dtype: torch.dtype = BF16, d: int = 128, q_start: int | list[int] = 0,
        k_start: int | list[int] = 0, varlen: bool = False, via: str = "direct",
        mode: str | None = None) -> None:
    """A random batch through the Gluon kernel against the float64 reference, sequence by
    sequence. Dense (varlen=False): every sequence has lens_q[0] / lens_k[0] rows. Offsets: ints
    or per-sequence lists (-> int32 / int64 tensors). via "api": longctx.attention, asserting
    that the dispatch took the Gluon kernel; "triton": longctx.attention with the Triton kernel
    chosen (LONGCTX_PREFILL_KERNEL=triton); "direct": hopper_attention_fwd (any shape, also
    those the dispatch leaves to the Triton kernel), descriptors `mode` (None: its default)."""
    scale = d ** -0.5
    b = len(lens_q)
    qs, ks = as_offset(q_start, torch.int32), as_offset(k_start, torch.int64)
    kw = dict(causal=causal, softmax_scale=scale, q_start=qs, k_start=ks)
    if varlen:
        cu = [torch.tensor([0] + list(itertools.accumulate(n)), dtype=torch.int32, device="cuda")
              for n in (lens_q, lens_k)]
        q = rand(sum(lens_q), hq, d, dtype=dtype)
        k, v = (rand(sum(lens_k), hkv, d, dtype=dtype) for _ in range(2))
        kw.update(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=max(lens_q),
                  max_seqlen_k=max(lens_k))
        rows = [(int(cu[0][i]), int(cu[0][i + 1]), int(cu[1][i]), int(cu[1][i + 1]))
                for i in range(b)]
    else:
        assert len(set(lens_q)) == 1 and len(set(lens_k)) == 1
        q = rand(b, lens_q[0], hq, d, dtype=dtype)
        k, v = (rand(b, lens_k[0], hkv, d, dtype=dtype) for _ in range(2))
    if via in ("api", "triton"):
        assert mode is None
        with gluon_counter() as calls, P.prefill_kernel("auto" if via == "api" else "triton"):
            o, lse = longctx.attention(q, k, v, return_lse=True, **kw)
        assert len(calls) == (via == "api"), f"the dispatch did not take the kernel asked ({via})"
    else:
        kw.pop("max_seqlen_k", None)
        o, lse = hopper_fwd(q, k, v, **dict(kw, causal=causal), mode=mode)
    assert o.shape == q.shape and o.dtype == dtype
    for i in range(b):
        args = (scale, causal, per_seq(q_start, i), per_seq(k_start, i))
        if varlen:
            a, e, ka, ke = rows[i]
            check_seq(o[a:e], lse[a:e], q[a:e], k[ka:ke], v[ka:ke], *args)
        else:
            check_seq(o[i], lse[i], q[i], k[i], v[i], *args)


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n,group,via", [
    (1, 3, "direct"), (127, 1, "direct"), (129, 8, "direct"), (1000, 3, "direct"),
    (12000, 8, "api"), (65537, 3, "api"),
], ids=lambda x: str(x))
def test_lengths(n: int, group: int, via: str, causal: bool) -> None:
    """Sq = Sk = n, B = 1 (host descriptors: TMA bounds at the sequence's end), GQA group 1/3/8
    with one KV head; the long ones through longctx.attention (the dispatch takes them)."""
    torch.manual_seed(n + group)
    run([n], [n], group, 1, causal=causal, via=via)


@pytest.mark.gpu
@hopper_gpu
@HALF
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n,group,via", [
    (1, 8, "direct"), (129, 3, "direct"), (1000, 1, "direct"), (12000, 3, "api"),
], ids=lambda x: str(x))
def test_lengths_batch_2(n: int, group: int, via: str, causal: bool, dtype: torch.dtype) -> None:
    """B = 2 with ragged lengths: device-side descriptors per (sequence, head)."""
    torch.manual_seed(2 * n + group)
    run([n, n], [n, n], 2 * group, 2, causal=causal, dtype=dtype, via=via)


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("sq,sk", [(1000, 1000), (129, 3000), (3000, 1)])
def test_device_descriptors_batch_1(sq: int, sk: int, causal: bool) -> None:
    """The device-side descriptors forced where the host ones would do (B = 1): same results."""
    torch.manual_seed(sq + sk)
    run([sq], [sk], 6, 2, causal=causal, mode="device")


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("b,sq,sk,q_start,k_start,via", [
    pytest.param(1, 1000, 3000, 2000, 0, "direct", id="chunked-prefill-last-chunk"),
    pytest.param(1, 2100, 9000, 6900, 0, "api", id="chunked-prefill-2100-rows-api"),
    pytest.param(1, 1000, 1000, 0, 500, "direct", id="q-before-k-500-empty-rows"),
    pytest.param(1, 300, 200, 0, 1000, "direct", id="every-row-empty"),
    pytest.param(1, 129, 1, 5, 0, "direct", id="one-key"),
    pytest.param(1, 700, 700, 1 << 40, 0, "direct", id="huge-offset"),
    pytest.param(2, 1000, 3000, [2000, 0], [0, 700], "direct", id="tensor-offsets-batch-2"),
    pytest.param(2, 1000, 3000, [-1000, -7], [-3000, 0], "direct", id="negative-offsets"),
    pytest.param(2, 1024, 1024, [0, 300], [0, 0], "direct", id="tensor-offsets-host-descriptors"),
    pytest.param(1, 4000, 5000, [1000], [0], "api", id="tensor-offsets-api"),
    pytest.param(2, 2500, 2500, 100, 400, "api", id="batch-2-offsets-api"),
])
def test_causal_offsets(b: int, sq: int, sk: int, q_start, k_start, via: str) -> None:
    """Causal with q_start / k_start: the band at any offset (spanning two key tiles), rows that
    see no key (O = 0, LSE = -inf), ints and [B] tensors, GQA group 3."""
    torch.manual_seed(sq + sk)
    run([sq] * b, [sk] * b, 6 if via == "direct" else 24, 2 if via == "direct" else 8,
        causal=True, q_start=q_start, k_start=k_start, via=via)


@pytest.mark.gpu
@hopper_gpu
@HALF
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_varlen(causal: bool, dtype: torch.dtype) -> None:
    """Varlen, ragged lengths with a 0- and a 1-row sequence, GQA group 8."""
    torch.manual_seed(31 + causal)
    lens = [0, 1, 127, 129, 1000, 3000, 1]
    run(lens, lens, 8, 1, causal=causal, dtype=dtype, varlen=True)


@pytest.mark.gpu
@hopper_gpu
def test_varlen_chunked_offsets() -> None:
    """Varlen chunked prefill: new rows at the end of cached keys, per-sequence offsets (a
    sequence with no new rows, one whose rows come before its keys, one with no keys)."""
    torch.manual_seed(33)
    run([1, 500, 0, 700, 129, 3], [50, 2000, 10, 700, 129, 0], 6, 2, causal=True, varlen=True,
        q_start=[49, 1500, 0, 0, 7, 0], k_start=[0, 0, 0, 100, 0, 0])


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_varlen_api(causal: bool) -> None:
    """A varlen batch that the dispatch takes (8 sequences, 24576 rows, a 0- and a 1-row one)."""
    torch.manual_seed(35 + causal)
    lens = [0, 1, 6000, 129, 9000, 2000, 4446, 3000]
    run(lens, lens, 16, 2, causal=causal, varlen=True, via="api")


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("d", [64, 256, 40, 80, 96, 192, 160, 48])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_head_dims(d: int, causal: bool) -> None:
    """head_dim 64 and 256, one padded to 64's tile (40) and the split ones (80 = 64 + 16,
    96 = 64 + 32, 192 = 128 + 64, 160 = 128 + 32, 48 = 32 + 16): B = 1 (host descriptors for a
    power of two) and B = 2 ragged, offsets, varlen, GQA group 3 and 5; through the dispatch,
    which sends them all to the Gluon kernel."""
    torch.manual_seed(d + causal)
    run([1000], [1000], 6, 2, causal=causal, d=d)
    run([129, 129], [777, 777], 3, 1, causal=causal, d=d, q_start=600)
    run([1, 257, 0, 1000], [1, 257, 5, 1000], 10, 2, causal=causal, d=d, varlen=True)
    run([4000], [4000], 16, 2, causal=causal, d=d, via="api")


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("d", [96, 192])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_head_dims_padded(d: int, causal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The padded tiles at head_dims that run split by default (SPLIT_HEADS off, the A/B of
    bench/prefill_head_split.py): B = 2 ragged with an offset, varlen."""
    from longctx.kernels import prefill_hopper

    monkeypatch.setattr(prefill_hopper, "SPLIT_HEADS", False)
    assert prefill_hopper.head_tiles(d) == (triton.next_power_of_2(d), 0)
    torch.manual_seed(d + 4 + causal)
    run([129, 129], [777, 777], 3, 1, causal=causal, d=d, q_start=600)
    run([1, 257, 0, 1000], [1, 257, 5, 1000], 10, 2, causal=causal, d=d, varlen=True)


@pytest.mark.parametrize("name", ["bf16 D=128 causal out B=1 16/2 Sq=8192",
                                  "bf16 D=192 causal acc B=2 16/2 Sq=4000"])
def test_gluon_kernel_compiles_for_sm90(name: str) -> None:
    """The Gluon kernel compiled offline for sm_90 with this Triton, no GPU needed
    (bench/compile_prefill_hopper.py: no spills, no wgmma serialization, registers within each
    partition's limit): what keeps a Triton whose Gluon API moved (3.9 renamed the TMA copies)
    from breaking the kernel unseen. One host-descriptor and one split-head accumulate variant; in a child process,
    as test_hopper_module_imports."""
    pytest.importorskip("triton.experimental.gluon")
    script = Path(__file__).resolve().parents[1] / "bench" / "compile_prefill_hopper.py"
    run = subprocess.run([sys.executable, str(script), "-k", name, "-j", "1"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert " ok" in run.stdout and "1 launches" in run.stdout, run.stdout


def test_head_tiles() -> None:
    """Which head_dims run split and how (kernels/prefill_hopper.py `head_tiles`); in a child
    process, as test_hopper_module_imports."""
    pytest.importorskip("triton.experimental.gluon")
    code = ("from longctx.kernels.prefill_hopper import head_tiles as t; "
            "print([t(d) for d in (64, 128, 256, 192, 160, 144, 96, 80, 48, 40, 56, 112, 248)])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str([(64, 0), (128, 0), (256, 0), (128, 64), (128, 32),
                                      (128, 16), (64, 32), (64, 16), (32, 16), (64, 0), (64, 0),
                                      (128, 0), (256, 0)])


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("d", [96, 192])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_head_dims_triton_kernel(d: int, causal: bool) -> None:
    """The Triton kernel (LONGCTX_PREFILL_KERNEL=triton) at padded head_dims and realistic
    sizes: 8192 rows of 32 / 8 heads (GQA 4; Phi-3's 96), a chunk after a cached prefix,
    varlen."""
    torch.manual_seed(d + 2 + causal)
    run([8192], [8192], 32, 8, causal=causal, d=d, via="triton")
    run([1500, 1500], [1500, 1500], 10, 2, causal=causal, d=d, via="triton")  # B = 2, GQA 5
    run([3000], [7000], 12, 4, causal=causal, d=d, q_start=4000, via="triton")
    run([0, 1, 3000, 129], [5, 1, 3000, 2000], 16, 2, causal=causal, d=d, varlen=True,
        via="triton")


@pytest.mark.gpu
@hopper_gpu
@HALF
@pytest.mark.parametrize("sq,sk", [(s, s) for s in (128, 256, 384, 1024)]
                         + [(256, 640), (640, 128), (128, 1024), (1024, 384)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_multiples_of_128(sq: int, sk: int, causal: bool, dtype: torch.dtype) -> None:
    """Sq, Sk multiples of 128, B = 2: host descriptors over [B * S, H * D] (no tile straddles
    two sequences); causal with Sq != Sk and q_start = k_start = 0 (rows see Sq-aligned keys)."""
    torch.manual_seed(sq + sk + causal)
    run([sq, sq], [sk, sk], 6, 2, causal=causal, dtype=dtype)


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (12, 4), (4, 4), (8, 1)],
                         ids=["gqa-8-2", "gqa-12-4", "mha-4-4", "mqa-8-1"])
def test_gqa_groups(hq: int, hkv: int, causal: bool) -> None:
    torch.manual_seed(hq + 16 * hkv)
    run([384, 384], [384, 384], hq, hkv, causal=causal)
    run([2048], [2048], hq, hkv, causal=causal)  # 16 key tiles: many ring laps (slot parities)


def initial_state(b: int, sq: int, hq: int, d: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A running state whose odd rows are empty (LSE -inf, O NaN: never to be read) and whose
    even rows hold a finite partial result."""
    o_acc = torch.randn(b, sq, hq, d, device="cuda")
    lse_acc = torch.randn(b, sq, hq, device="cuda") * 3
    o_acc[:, 1::2] = float("nan")
    lse_acc[:, 1::2] = float("-inf")
    return o_acc, lse_acc


@pytest.mark.gpu
@hopper_gpu
@HALF
@pytest.mark.parametrize("b,sq,group,sk", [(2, 384, 1, 256), (2, 384, 3, 128), (2, 1000, 3, 777),
                                           (1, 1000, 1, 777), (1, 129, 8, 1)],
                         ids=["aligned-group-1", "aligned-one-kv-tile", "ragged-batch-2",
                              "ragged-batch-1", "ragged-one-key"])
def test_accumulate(b: int, sq: int, group: int, sk: int, dtype: torch.dtype,
                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A ring rank's steps on the Gluon kernel's fused merge: a key block of another rank (no
    mask, Sq != Sk), the rank's own causal diagonal block and a causal block at an offset, folded
    into a state with empty (NaN) rows; against the same steps through attention_merge_into on
    the Triton kernel and against the float64 reference (within 2x the Triton kernel's error).
    Ragged lengths: rows past Sq are never touched."""
    run_accumulate(b, sq, group, sk, dtype, 128, monkeypatch)


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("split", [True, False], ids=["split", "padded"])
@pytest.mark.parametrize("d", [96, 192])
def test_accumulate_head_dim_not_power_of_two(d: int, split: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`test_accumulate` at head_dims that are not powers of two, split in two tiles or padded:
    the columns past D of a row of the state are the next head's, which the fused merge must
    neither read nor write."""
    from longctx.kernels import prefill_hopper

    monkeypatch.setattr(prefill_hopper, "SPLIT_HEADS", split)
    run_accumulate(2, 1000, 3, 777, BF16, d, monkeypatch)


def run_accumulate(b: int, sq: int, group: int, sk: int, dtype: torch.dtype, d: int,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`test_accumulate`'s steps at head_dim d."""
    torch.manual_seed(70 + group + sk + sq)
    hkv = 2
    hq = group * hkv
    q = rand(b, sq, hq, d, dtype=dtype)
    blocks = [(sk, False, 0, 0), (sq, True, 0, 0), (sk, True, 300, 0)]
    steps = [(rand(b, n, hkv, d, dtype=dtype), rand(b, n, hkv, d, dtype=dtype), c, qs, ks)
             for n, c, qs, ks in blocks]
    scale = d ** -0.5
    # the state is a slice of a longer buffer: rows past Sq must stay as they are
    full = initial_state(b, sq + 5, hq, d)
    state = tuple(x[:, :sq] for x in full)
    gluon, triton_ = (tuple(t.clone() for t in full) for _ in range(2))
    for k, v, causal, qs, ks in steps:
        out = hopper_fwd(q, k, v, softmax_scale=scale, causal=causal, q_start=qs, k_start=ks,
                         accumulate=tuple(x[:, :sq] for x in gluon))
        assert out is None
    monkeypatch.setattr(P, "_prefill_choice", "triton")
    for k, v, causal, qs, ks in steps:
        longctx.attention_merge_into(*(x[:, :sq] for x in triton_), q, k, v, causal=causal,
                                     softmax_scale=scale, q_start=qs, k_start=ks)
    for name, st in (("gluon", gluon), ("triton", triton_)):  # the rows past Sq: untouched
        assert torch.equal(st[1][:, sq:], full[1][:, sq:]), name
        assert torch.equal(st[0][:, sq:].nan_to_num(7.0), full[0][:, sq:].nan_to_num(7.0)), name
    gluon, triton_ = (tuple(x[:, :sq] for x in st) for st in (gluon, triton_))
    # float64 reference: the initial state (its empty rows' O as 0, as the torch merge needs)
    # merged with every block's exact state
    o_ref, lse_ref = state[0].nan_to_num(0.0).cpu().double(), state[1].cpu().double()
    for k, v, causal, qs, ks in steps:
        parts = [ref_seq(q[i], k[i], v[i], scale, causal, qs, ks) for i in range(b)]
        o_p = torch.stack([p[0] for p in parts])
        lse_p = torch.stack([p[1] for p in parts])
        longctx.merge_into(o_ref, lse_ref, o_p, lse_p)
    for name, (o, lse) in (("gluon", gluon), ("triton", triton_)):
        assert not o.isnan().any() and torch.isfinite(lse).all(), name
    err = {name: (o.cpu().double() - o_ref).abs().max().item() for name, (o, _) in
           (("gluon", gluon), ("triton", triton_))}
    assert err["gluon"] <= 2 * err["triton"] + 1e-5, err
    assert (gluon[1] - triton_[1]).abs().max().item() < 1e-4
    assert (gluon[1].cpu().double() - lse_ref).abs().max().item() < 1e-4


# --------------------------------------------------------------------------- #
# The dispatch on an sm_90 GPU
# --------------------------------------------------------------------------- #
@pytest.fixture
def gluon_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict]]:
    """gluon_counter() over a whole test, with the default kernel choice ("auto")."""
    monkeypatch.setattr(P, "_prefill_choice", "auto")
    with gluon_counter() as calls:
        yield calls


@pytest.mark.gpu
@hopper_gpu
def test_dispatch_picks_the_gluon_kernel(gluon_calls: list[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """longctx.attention / attention_merge_into run the Gluon kernel where the rule says so
    (with correct results), the Triton kernel elsewhere and under LONGCTX_PREFILL_KERNEL=triton."""
    torch.manual_seed(80)
    # causal from 2048 rows, any length: the Gluon kernel, checked against the reference
    q = rand(1, 4225, 16, 128, dtype=BF16)
    k, v = rand(1, 4225, 2, 128, dtype=BF16), rand(1, 4225, 2, 128, dtype=BF16)
    o, lse = longctx.attention(q, k, v, causal=True, return_lse=True)
    assert len(gluon_calls) == 1
    check_seq(o[0], lse[0], q[0], k[0], v[0], 128 ** -0.5, True, 0, 0)
    # no mask from 512 programs (16 heads x 32 query tiles), fused merge, offsets: Gluon
    o_acc = torch.zeros(1, 4225, 16, 128, device="cuda")
    lse_acc = torch.full((1, 4225, 16), float("-inf"), device="cuda")
    longctx.attention(q[:, :4096], k, v)
    longctx.attention_merge_into(o_acc, lse_acc, q, k, v)
    longctx.attention(q, k, v, causal=True, q_start=5)
    assert len(gluon_calls) == 4
    # the Triton kernel: causal below 2048 rows, no mask with 256 or 32 programs, fp32
    longctx.attention(q[:, :1920], k[:, :1920], v[:, :1920], causal=True)
    longctx.attention(q[:, :2048], k, v)
    longctx.attention(q[:, :200], k, v)
    longctx.attention(q.float(), k.float(), v.float())
    assert len(gluon_calls) == 4
    monkeypatch.setattr(P, "_prefill_choice", "triton")
    o_t = longctx.attention(q, k, v, causal=True)
    longctx.attention_merge_into(o_acc, lse_acc, q, k, v)
    assert len(gluon_calls) == 4
    torch.testing.assert_close(o_t, o, atol=2e-2, rtol=2e-2)  # the two kernels agree


@pytest.mark.gpu
@hopper_gpu
def test_ring_plan_on_the_gluon_kernel(gluon_calls: list[dict],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-rank zigzag causal ring's steps on one GPU (tests/test_ring_gpu.py) at a length where
    every block runs the Gluon kernel (the rank's own 8192 rows causal, 4096 x 8192 / 8192 x 4096
    unmasked): each rank's state against fp32 SDPA, within 2x the error of the Triton kernel's
    one-device call."""
    from longctx.parallel.ring import shard_chunks
    from tests.test_ring_gpu import _ring_sequence

    g = torch.Generator(device="cuda").manual_seed(2)
    S, hq, hkv = 16384, 16, 2  # the remote blocks: 4096 x 8192 rows x 16 heads = 512 programs
    q = torch.randn(1, S, hq, 128, device="cuda", generator=g).to(BF16)
    k, v = (torch.randn(1, S, hkv, 128, device="cuda", generator=g).to(BF16) for _ in range(2))
    # KV heads repeated rather than enable_gqa: fp32 SDPA then runs its memory-efficient kernel
    # (O(S) memory) where the math one held 2 x 17 GB of scores, an OOM on an 80 GB GPU shared
    # with the suite's other workers.
    kr, vr = (x.repeat_interleave(hq // hkv, dim=2) for x in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.float().transpose(1, 2) for x in (q, kr, vr)), is_causal=True).transpose(1, 2)
    del kr, vr
    errs = []
    for rank in range(2):
        o_acc, _ = _ring_sequence(q, k, v, 2, rank, sync=False)
        ref_r = torch.cat([ref[:, a:a + n] for a, n in shard_chunks(S, 2, rank, "zigzag")], 1)
        errs.append((o_acc.to(BF16).float() - ref_r).abs().max().item())
    assert len(gluon_calls) == 4  # per rank: its own shard, one coalesced block of the other's
    monkeypatch.setattr(P, "_prefill_choice", "triton")
    one = longctx.attention(q, k, v, causal=True)
    assert len(gluon_calls) == 4
    bar = 2 * (one.float() - ref).abs().max().item()
    assert max(errs) <= bar, (errs, bar)
