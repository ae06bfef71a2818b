"""The Hopper prefill path: the dispatch rule (`hopper_kernel_applies`, on any machine) and the
Gluon kernel (kernels/prefill_hopper.py, on an sm_90 GPU only) against the float64 reference.

GPU tests import the Gluon module inside the test: it must never be imported on a CPU or under
the interpreter. Errors are judged as in tests/test_prefill.py (at most 2x the error of a plain
PyTorch implementation in the same dtype); the fused merge is compared with the Triton kernel's
(LONGCTX_PREFILL_KERNEL=triton).
"""

from __future__ import annotations

import sys

import pytest
import torch

import longctx
import longctx.kernels.prefill as P
from longctx.backend import force_triton
from longctx.kernels.prefill import hopper_kernel_applies
from tests.test_prefill import check, rand, ref_seq, torch_half_seq

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
              capability=(9, 0), causal=False, q_start=0, k_start=0, varlen=False,
              config_given=False, accumulate_strides=None)
    kw.update(changes)
    return hopper_kernel_applies(**kw)


PACKED = contiguous((2, 8192, 20, 128))  # a qkv projection: q = heads 0..15, k 16..17, v 18..19
BHSD = (8192 * 16 * 128, 128, 8192 * 128, 1)  # q of [B, H, S, D] memory, transposed to [B, S, H, D]
KV = contiguous((2, 8192, 2, 128))


def q_strides(q: tuple[int, ...]) -> dict:
    """`call` changes: q with these strides, k and v contiguous."""
    return dict(strides=(q, KV, KV))


ACCEPTED = [
    pytest.param({}, id="dense-no-mask"),
    pytest.param(dict(causal=True), id="causal-diagonal-8192-rows"),
    pytest.param(dict(causal=True, q_start=1000, k_start=1000), id="causal-equal-int-offsets"),
    pytest.param(dict(dtypes=(FP16,) * 3), id="fp16"),
    pytest.param(dict(q=(2, 2048, 16, 128), k=(2, 640, 2, 128)), id="no-mask-sq-ne-sk"),
    pytest.param(dict(q=(2, 2048, 16, 128), k=(2, 128, 2, 128)), id="no-mask-one-kv-tile"),
    pytest.param(dict(q=(1, 4096, 16, 128), k=(1, 4096, 2, 128)), id="no-mask-512-programs"),
    pytest.param(dict(causal=True, q=(1, 2048, 16, 128), k=(1, 2048, 2, 128)),
                 id="causal-2048-rows"),
    pytest.param(dict(q=(2, 8192, 12, 128), k=(2, 8192, 4, 128)), id="gqa-group-3-12-4"),
    pytest.param(dict(q=(2, 8192, 8, 128), k=(2, 8192, 1, 128)), id="mqa-group-8"),
    pytest.param(dict(q_start=torch.tensor([0, 5]), k_start=7),
                 id="no-mask-tensor-offsets-ignored"),
    pytest.param(dict(q=(1, 8192, 16, 128), k=(1, 8192, 2, 128),
                      strides=((3 << 30, 2048, 128, 1), (5, 256, 128, 1), (7, 256, 128, 1))),
                 id="batch-1-any-batch-stride"),
    pytest.param(dict(strides=(PACKED,) * 3,
                      data_ptrs=(1 << 20, (1 << 20) + 16 * 256, (1 << 20) + 18 * 256)),
                 id="packed-qkv-views"),
    pytest.param(dict(accumulate_strides=(contiguous((2, 8192, 16, 128)),
                                          contiguous((2, 8192, 16)))),
                 id="accumulate-contiguous"),
    pytest.param(dict(q=(1, 8192, 16, 128), k=(1, 8192, 2, 128),
                      accumulate_strides=((2 * 8192 * 2048, 2048, 128, 1), (2 * 8192 * 16, 16, 1))),
                 id="accumulate-batch-1-slice-of-longer-state"),
]

DECLINED = [
    pytest.param(dict(capability=(8, 0)), id="not-hopper-sm80"),
    pytest.param(dict(capability=(10, 0)), id="not-hopper-sm100"),
    pytest.param(dict(capability=None), id="not-cuda"),
    pytest.param(dict(config_given=True), id="config-override"),
    pytest.param(dict(q=(16384, 16, 128), k=(16384, 2, 128), varlen=True,
                      strides=((2048, 128, 1), (256, 128, 1), (256, 128, 1))), id="varlen"),
    pytest.param(dict(dtypes=(torch.float32,) * 3), id="fp32"),
    pytest.param(dict(dtypes=(BF16, FP16, FP16)), id="mixed-dtypes"),
    pytest.param(dict(q=(2, 8192, 16, 64), k=(2, 8192, 2, 64)), id="head-dim-64"),
    pytest.param(dict(q=(2, 200, 16, 128)), id="sq-not-multiple-of-128"),
    pytest.param(dict(k=(2, 1000, 2, 128)), id="sk-not-multiple-of-128"),
    pytest.param(dict(q=(0, 8192, 16, 128), k=(0, 8192, 2, 128)), id="empty-batch"),
    pytest.param(q_strides((8192 * 16 * 256, 16 * 256, 256, 2)), id="head-dim-stride-not-1"),
    pytest.param(q_strides(BHSD), id="heads-not-adjacent-bhsd-memory"),
    pytest.param(q_strides((2 * 8192 * 2048, 2048, 128, 1)), id="batch-stride-not-sq-rows"),
    pytest.param(dict(data_ptrs=((1 << 20) + 2, 1 << 20, 1 << 20)), id="q-not-16-byte-aligned"),
    pytest.param(q_strides((8192 * 2052, 2052, 128, 1)), id="row-stride-not-16-bytes"),
    pytest.param(dict(q=(1, 8192, 16, 128), k=(1, 8192, 2, 128),
                      strides=(contiguous((1, 8192, 16, 128)), (0, 0, 128, 1), (0, 0, 128, 1))),
                 id="k-rows-overlap-expanded"),
    pytest.param(dict(causal=True, q=(2, 1920, 16, 128), k=(2, 1920, 2, 128)),
                 id="causal-below-2048-rows-stays-on-triton"),
    pytest.param(dict(q=(1, 2048, 16, 128), k=(1, 2048, 2, 128)),
                 id="no-mask-256-programs-stays-on-triton"),
    pytest.param(dict(causal=True, k=(2, 16384, 2, 128)), id="causal-sq-ne-sk"),
    pytest.param(dict(causal=True, q_start=0, k_start=128), id="causal-offsets-differ"),
    pytest.param(dict(causal=True, q_start=torch.tensor([0, 0]), k_start=torch.tensor([0, 0])),
                 id="causal-tensor-offsets"),
    pytest.param(dict(accumulate_strides=((2 * 8192 * 2048, 2048, 128, 1),
                                          contiguous((2, 8192, 16)))),
                 id="accumulate-o-acc-batch-stride-not-sq-rows"),
    pytest.param(dict(accumulate_strides=(contiguous((2, 8192, 16, 128)), (2 * 8192 * 16, 16, 1))),
                 id="accumulate-lse-acc-batch-stride-not-sq-rows"),
]


@pytest.mark.parametrize("changes", ACCEPTED)
def test_hopper_kernel_applies_accepts(changes: dict) -> None:
    assert call(**changes)


@pytest.mark.parametrize("changes", DECLINED)
def test_hopper_kernel_applies_declines(changes: dict) -> None:
    assert not call(**changes)


def test_prefill_kernel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """LONGCTX_PREFILL_KERNEL: unset / "" / "auto" allow the Hopper kernel, "triton" forbids it,
    anything else is an error naming the variable."""
    monkeypatch.delenv("LONGCTX_PREFILL_KERNEL", raising=False)
    assert P._prefill_kernel_choice() == "auto"
    for value, choice in (("", "auto"), ("auto", "auto"), ("triton", "triton")):
        monkeypatch.setenv("LONGCTX_PREFILL_KERNEL", value)
        assert P._prefill_kernel_choice() == choice
    monkeypatch.setenv("LONGCTX_PREFILL_KERNEL", "gluon")
    with pytest.raises(ValueError, match="LONGCTX_PREFILL_KERNEL"):
        P._prefill_kernel_choice()


def test_hopper_module_import_error_means_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Triton without Gluon for Hopper: the import fails and the Triton kernel runs."""
    # None in sys.modules: importing the module raises ImportError
    monkeypatch.setitem(sys.modules, "longctx.kernels.prefill_hopper", None)
    P._hopper_module.cache_clear()
    try:
        assert P._hopper_module() is None
    finally:
        P._hopper_module.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case (Triton interpreter)")
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
# The Gluon kernel (sm_90 GPU)
# --------------------------------------------------------------------------- #
def hopper_fwd(*args, **kwargs):
    from longctx.kernels.prefill_hopper import hopper_attention_fwd

    return hopper_attention_fwd(*args, **kwargs)


def run_hopper(b: int, sq: int, sk: int, hq: int, hkv: int, dtype: torch.dtype,
               causal: bool) -> None:
    """The Gluon kernel called directly (any Sq, Sk multiples of 128, causal at any length)
    against the float64 reference, sequence by sequence."""
    q = rand(b, sq, hq, 128, dtype=dtype)
    k, v = rand(b, sk, hkv, 128, dtype=dtype), rand(b, sk, hkv, 128, dtype=dtype)
    scale = 128 ** -0.5
    o, lse = hopper_fwd(q, k, v, softmax_scale=scale, causal=causal, q_start=0, k_start=0)
    assert o.shape == q.shape and o.dtype == dtype and o.is_contiguous()
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    for i in range(b):
        o_ref, lse_ref = ref_seq(q[i], k[i], v[i], scale, causal, 0, 0)
        o_half = torch_half_seq(q[i], k[i], v[i], scale, causal, 0, 0)
        check(o[i], lse[i], o_ref, lse_ref, dtype, o_half)


@pytest.mark.gpu
@hopper_gpu
@HALF
@pytest.mark.parametrize("sq,sk,causal", [
    # causal: query tile m visits key tiles 0..m (n_tiles 1..8; 1 = the diagonal as S_0)
    pytest.param(s, s, c, id=f"{'causal' if c else 'full'}-{s // 128}-kv-tiles")
    for c in (True, False) for s in (128, 256, 384, 1024)
] + [
    pytest.param(256, 640, False, id="full-sq256-sk640"),
    pytest.param(640, 128, False, id="full-sq640-sk128-one-kv-tile"),
    pytest.param(128, 1024, False, id="full-sq128-sk1024"),
    pytest.param(1024, 384, False, id="full-sq1024-sk384"),
])
def test_kernel_matches_reference(sq: int, sk: int, causal: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(sq + sk + causal)
    run_hopper(2, sq, sk, 6, 2, dtype, causal)


@pytest.mark.gpu
@hopper_gpu
@HALF
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (12, 4), (4, 4), (8, 1)],
                         ids=["gqa-8-2", "gqa-12-4", "mha-4-4", "mqa-8-1"])
def test_kernel_gqa_groups(hq: int, hkv: int, causal: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(hq + 16 * hkv)
    run_hopper(2, 384, 384, hq, hkv, dtype, causal)


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_kernel_batch_1_long(causal: bool) -> None:
    """B = 1 (any batch stride) at 2048 rows, 16 key tiles: many ring laps (slot parities)."""
    torch.manual_seed(5 + causal)
    run_hopper(1, 2048, 2048, 4, 2, BF16, causal)


def initial_state(b: int, sq: int, hq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A running state whose odd rows are empty (LSE -inf, O NaN: never to be read) and whose
    even rows hold a finite partial result."""
    o_acc = torch.randn(b, sq, hq, 128, device="cuda")
    lse_acc = torch.randn(b, sq, hq, device="cuda") * 3
    o_acc[:, 1::2] = float("nan")
    lse_acc[:, 1::2] = float("-inf")
    return o_acc, lse_acc


@pytest.mark.gpu
@hopper_gpu
@HALF
@pytest.mark.parametrize("group,sk", [(1, 256), (3, 256), (3, 128)],
                         ids=["group-1", "group-3", "group-3-one-kv-tile"])
def test_kernel_accumulate_matches_triton(group: int, sk: int, dtype: torch.dtype,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A ring rank's steps on the Gluon kernel's fused merge: a key block of another rank (no
    mask, Sq != Sk) and the rank's own causal diagonal block, folded into a state with empty
    (NaN) rows; against the same steps through attention_merge_into on the Triton kernel and
    against the float64 reference (within 2x the Triton kernel's error)."""
    torch.manual_seed(70 + group + sk)
    b, sq, hkv = 2, 384, 2
    hq = group * hkv
    q = rand(b, sq, hq, 128, dtype=dtype)
    k_other, v_other = rand(b, sk, hkv, 128, dtype=dtype), rand(b, sk, hkv, 128, dtype=dtype)
    k_own, v_own = rand(b, sq, hkv, 128, dtype=dtype), rand(b, sq, hkv, 128, dtype=dtype)
    steps = [(k_other, v_other, False), (k_own, v_own, True)]
    scale = 128 ** -0.5
    state = initial_state(b, sq, hq)
    gluon, triton_ = (tuple(t.clone() for t in state) for _ in range(2))
    for k, v, causal in steps:
        out = hopper_fwd(q, k, v, softmax_scale=scale, causal=causal, q_start=0, k_start=0,
                         accumulate=gluon)
        assert out is None
    monkeypatch.setenv("LONGCTX_PREFILL_KERNEL", "triton")
    for k, v, causal in steps:
        longctx.attention_merge_into(*triton_, q, k, v, causal=causal, softmax_scale=scale)
    # float64 reference: the initial state (its empty rows' O as 0, as the torch merge needs)
    # merged with both blocks' exact states
    o_ref, lse_ref = state[0].nan_to_num(0.0).cpu().double(), state[1].cpu().double()
    for k, v, causal in steps:
        parts = [ref_seq(q[i], k[i], v[i], scale, causal, 0, 0) for i in range(b)]
        o_p = torch.stack([p[0] for p in parts])
        lse_p = torch.stack([p[1] for p in parts]).transpose(1, 2)
        longctx.merge_into(o_ref, lse_ref, o_p, lse_p.contiguous())
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
def gluon_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Records every hopper_attention_fwd call that flash_attention_fwd makes."""
    from longctx.kernels import prefill_hopper

    calls, real = [], prefill_hopper.hopper_attention_fwd

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.delenv("LONGCTX_PREFILL_KERNEL", raising=False)
    monkeypatch.setattr(prefill_hopper, "hopper_attention_fwd", counted)
    return calls


@pytest.mark.gpu
@hopper_gpu
def test_dispatch_picks_the_gluon_kernel(gluon_calls: list[dict],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """longctx.attention / attention_merge_into run the Gluon kernel where the rule says so
    (with correct results), the Triton kernel elsewhere and under LONGCTX_PREFILL_KERNEL=triton."""
    torch.manual_seed(80)
    # causal from 2048 rows: the Gluon kernel, checked against the reference
    q = rand(1, 4224, 16, 128, dtype=BF16)
    k, v = rand(1, 4224, 2, 128, dtype=BF16), rand(1, 4224, 2, 128, dtype=BF16)
    o, lse = longctx.attention(q, k, v, causal=True, return_lse=True)
    assert len(gluon_calls) == 1 and gluon_calls[0]["causal"]
    o_ref, lse_ref = ref_seq(q[0], k[0], v[0], 128 ** -0.5, True, 0, 0)
    o_half = torch_half_seq(q[0], k[0], v[0], 128 ** -0.5, True, 0, 0)
    check(o[0], lse[0], o_ref, lse_ref, BF16, o_half)
    # no mask from 512 programs (16 heads x 32 query tiles), fused merge: the Gluon kernel
    o_acc = torch.zeros(1, 4224, 16, 128, device="cuda")
    lse_acc = torch.full((1, 4224, 16), float("-inf"), device="cuda")
    longctx.attention(q[:, :4096], k, v)
    longctx.attention_merge_into(o_acc, lse_acc, q, k, v)
    assert len(gluon_calls) == 3 and gluon_calls[2]["accumulate"] is not None
    # the Triton kernel: causal below 2048 rows, no mask with 256 programs, ragged lengths,
    # offsets, fp32
    longctx.attention(q[:, :1920], k[:, :1920], v[:, :1920], causal=True)
    longctx.attention(q[:, :2048], k, v)
    longctx.attention(q[:, :200], k, v)
    longctx.attention(q, k, v, causal=True, q_start=5)
    longctx.attention(q.float(), k.float(), v.float())
    assert len(gluon_calls) == 3
    monkeypatch.setenv("LONGCTX_PREFILL_KERNEL", "triton")
    o_t = longctx.attention(q, k, v, causal=True)
    longctx.attention_merge_into(o_acc, lse_acc, q, k, v)
    assert len(gluon_calls) == 3
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
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.float().transpose(1, 2) for x in (q, k, v)), is_causal=True,
        enable_gqa=True).transpose(1, 2)
    errs = []
    for rank in range(2):
        o_acc, _ = _ring_sequence(q, k, v, 2, rank, sync=False)
        ref_r = torch.cat([ref[:, a:a + n] for a, n in shard_chunks(S, 2, rank, "zigzag")], 1)
        errs.append((o_acc.to(BF16).float() - ref_r).abs().max().item())
    assert len(gluon_calls) == 4  # per rank: its own shard, one coalesced block of the other's
    monkeypatch.setenv("LONGCTX_PREFILL_KERNEL", "triton")
    one = longctx.attention(q, k, v, causal=True)
    assert len(gluon_calls) == 4
    bar = 2 * (one.float() - ref).abs().max().item()
    assert max(errs) <= bar, (errs, bar)
