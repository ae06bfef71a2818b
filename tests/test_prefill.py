"""The Triton FlashAttention forward (longctx.kernels.prefill) against the float64 reference.

On CPU the kernel runs under the Triton interpreter (bf16 is skipped there: the interpreter's
bf16 arithmetic is not faithful); on a GPU the same tests run compiled, bf16 included. Shapes
are tiny on purpose.
"""

from __future__ import annotations


import pytest
import torch

import longctx
from longctx.backend import force_triton
import longctx.kernels.prefill as P
from longctx.kernels.prefill import LAUNCH_CONFIGS, flash_attention_fwd, launch_config
from longctx.reference import reference_attention
from tests.env import DEVICE


FP32_TOL = 2e-5
HALF = [torch.float16] if DEVICE == "cpu" else [torch.float16, torch.bfloat16]


def ref_seq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
            q_start: int, k_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference for one sequence: q [Sq, Hq, D], k/v [Sk, Hkv, D] ->
    o [Sq, Hq, D], lse [Sq, Hq] (float64, on the CPU)."""
    o, lse = reference_attention(q[None].cpu(), k[None].cpu(), v[None].cpu(), causal=causal,
                                 softmax_scale=scale, q_start=q_start, k_start=k_start,
                                 compute_dtype=torch.float64)
    return o[0], lse[0]


def torch_half_seq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                   q_start: int, k_start: int) -> torch.Tensor:
    """The plain PyTorch implementation in the inputs' half dtype (the 2x error bar)."""
    o, _ = reference_attention(q[None].cpu(), k[None].cpu(), v[None].cpu(), causal=causal,
                               softmax_scale=scale, q_start=q_start, k_start=k_start,
                               compute_dtype=q.dtype)
    return o[0]


def check(o: torch.Tensor, lse: torch.Tensor, o_ref: torch.Tensor, lse_ref: torch.Tensor,
          dtype: torch.dtype, o_half: torch.Tensor | None = None) -> None:
    """Compare one sequence: o [Sq, Hq, D], lse [Sq, Hq] against the f64 reference.

    fp32: absolute error < FP32_TOL. fp16/bf16: O error at most 2x that of the plain
    torch implementation in the same dtype (``o_half``) plus a tiny slack.
    """
    o, lse = o.cpu(), lse.cpu()
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    empty = torch.isneginf(lse_ref)  # [Sq, Hq]
    assert torch.equal(torch.isneginf(lse), empty), "empty-row pattern differs"
    assert (o[empty] == 0).all(), "rows with no visible key must be exactly 0"
    valid = ~empty
    if not valid.any():
        return
    o_err = (o.double() - o_ref)[valid].abs().max().item()
    lse_err = (lse.double()[valid] - lse_ref[valid]).abs().max().item()
    if dtype == torch.float32:
        assert o_err < FP32_TOL, o_err
        assert lse_err < FP32_TOL, lse_err
    else:
        assert o_half is not None
        t_err = (o_half.double() - o_ref)[valid].abs().max().item()
        assert o_err <= 2 * t_err + 1e-4, (o_err, t_err)
        assert lse_err < 1e-4, lse_err


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float32).to(device=DEVICE, dtype=dtype)


def ints(x: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype, device=DEVICE)


def run_dense(b: int, sq: int, sk: int, hq: int, hkv: int, d: int, dtype: torch.dtype, causal: bool,
              q_start, k_start, config: dict | None = None) -> None:
    """Random dense problem; q_start/k_start are ints or lists (-> per-sequence tensors)."""
    q = rand(b, sq, hq, d, dtype=dtype)
    k = rand(b, sk, hkv, d, dtype=dtype)
    v = rand(b, sk, hkv, d, dtype=dtype)
    scale = d ** -0.5
    qs_arg = ints(q_start, torch.int32) if isinstance(q_start, list) else q_start
    ks_arg = ints(k_start, torch.int64) if isinstance(k_start, list) else k_start
    o, lse = flash_attention_fwd(q, k, v, softmax_scale=scale, causal=causal,
                                 q_start=qs_arg, k_start=ks_arg, _config=config)
    assert o.shape == (b, sq, hq, d) and o.dtype == dtype
    assert lse.shape == (b, sq, hq) and lse.dtype == torch.float32
    for i in range(b):
        qs = q_start[i] if isinstance(q_start, list) else q_start
        ks = k_start[i] if isinstance(k_start, list) else k_start
        o_ref, lse_ref = ref_seq(q[i], k[i], v[i], scale, causal, qs, ks)
        oh = torch_half_seq(q[i], k[i], v[i], scale, causal, qs, ks) if dtype != torch.float32 else None
        check(o[i], lse[i], o_ref, lse_ref, dtype, oh)


# --------------------------------------------------------------------------- #
# Dense
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("s", [1, 97, 129, 200, 257])
@pytest.mark.parametrize("causal", [True, False])
def test_square_fp32(s: int, causal: bool) -> None:
    torch.manual_seed(s)
    run_dense(1, s, s, 2, 1, 64, torch.float32, causal, 0, 0)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("s,causal", [(1, True), (129, True), (200, False), (257, True)])
def test_square_half(s: int, causal: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(s + 1)
    run_dense(1, s, s, 2, 2, 64, dtype, causal, 0, 0)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32] + HALF)
@pytest.mark.parametrize("s,causal", [(97, True), (200, False)])
def test_head_dim_128(s: int, causal: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(7)
    run_dense(1, s, s, 2, 1, 128, dtype, causal, 0, 0)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_head_dim_256() -> None:
    torch.manual_seed(8)
    run_dense(1, 40, 70, 1, 1, 256, torch.float32, True, 30, 0)


# head_dims that are not powers of two: tiles of the next power of two, whose padding columns
# the tensor descriptors read as 0 and never store (and the accumulating epilogue masks)
ODD_HEAD_DIMS = [24, 40, 72, 80, 96, 192]


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32] + HALF)
@pytest.mark.parametrize("d", ODD_HEAD_DIMS)
def test_head_dim_not_power_of_two(d: int, dtype: torch.dtype) -> None:
    """Causal queries after a cached prefix (ragged tiles, tensor offsets with an all-empty
    sequence) with GQA group 3, and unmasked with GQA group 5."""
    torch.manual_seed(d)
    run_dense(2, 37, 70, 3, 1, d, dtype, True, [33, 0], [0, 50])
    run_dense(1, 45, 29, 5, 1, d, dtype, False, 0, 0)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("d", [40, 96, 192])
def test_head_dim_not_power_of_two_varlen(d: int) -> None:
    """Varlen chunked prefill at a padded head_dim: a 1-row, a 0-row and a ragged sequence."""
    torch.manual_seed(d + 1)
    run_varlen([1, 0, 37, 70], [20, 5, 37, 90], 4, 1, d, torch.float16, True, [19, 0, 0, 20],
               0)


@pytest.mark.parametrize("dtype", [torch.float32] + HALF)
@pytest.mark.parametrize(
    "sq,sk,q_start,k_start",
    [
        (50, 130, 80, 0),      # q_start > k_start: chunk of queries after a cached prefix
        (70, 90, 10, 40),      # q_start < k_start: first 30 rows see nothing
        (33, 64, 1000, 500),   # KV chunk entirely in the past: all visible
        (40, 50, 0, 100),      # KV chunk entirely in the future: every row empty
        (129, 65, 17, 81),     # ragged, diagonal crossing tiles
        (50, 130, -20, -100),  # negative positions: only q_start - k_start matters
    ],
)
@pytest.mark.gpu
@pytest.mark.interpreter
def test_offsets_causal(sq: int, sk: int, q_start: int, k_start: int, dtype: torch.dtype) -> None:
    torch.manual_seed(sq * 7 + sk)
    run_dense(1, sq, sk, 2, 1, 64, dtype, True, q_start, k_start)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_noncausal_rectangular() -> None:
    torch.manual_seed(3)
    run_dense(2, 45, 150, 2, 1, 64, torch.float32, False, 123, 7)  # offsets ignored
    run_dense(1, 150, 45, 2, 1, 64, torch.float32, False, 0, 0)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_tensor_offsets() -> None:
    torch.manual_seed(4)
    # per-sequence q_start (int32) and k_start (int64); includes an all-empty sequence
    run_dense(3, 60, 100, 2, 1, 64, torch.float32, True, [40, 0, 5], [0, 20, 300])
    # tensor + python int mix
    run_dense(2, 33, 70, 2, 1, 64, torch.float32, True, [0, 50], 10)
    # 0-dim tensor offset broadcasts over the batch
    q, k, v = rand(2, 20, 2, 64), rand(2, 30, 1, 64), rand(2, 30, 1, 64)
    o, lse = flash_attention_fwd(q, k, v, softmax_scale=0.125, causal=True,
                                 q_start=torch.tensor(15, device=DEVICE), k_start=0)
    for i in range(2):
        check(o[i], lse[i], *ref_seq(q[i], k[i], v[i], 0.125, True, 15, 0), torch.float32)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("group", [1, 2, 3, 8])
def test_gqa_groups(group: int) -> None:
    torch.manual_seed(group)
    hkv = 2 if group <= 3 else 1
    run_dense(1, 70, 70, group * hkv, hkv, 64, torch.float32, True, 0, 0)


@pytest.mark.parametrize("config", [
    {"BLOCK_M": 16, "BLOCK_N": 16},   # many unmasked + many diagonal tiles
    {"BLOCK_M": 32, "BLOCK_N": 64},   # BLOCK_N > BLOCK_M
    {"BLOCK_M": 64, "BLOCK_N": 16},   # diagonal band spans several KV tiles
])
@pytest.mark.gpu
@pytest.mark.interpreter
def test_block_configs(config: dict) -> None:
    torch.manual_seed(11)
    run_dense(1, 100, 140, 2, 1, 64, torch.float32, True, 60, 13, config=config)
    run_dense(1, 45, 45, 2, 1, 64, torch.float32, False, 0, 0, config=config)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("m_fastest", [False, True])
def test_grid_orders(m_fastest: bool) -> None:
    """Both program orders (heads fastest / query tiles fastest) cover every tile exactly once:
    several heads, two sequences, a ragged last query tile."""
    torch.manual_seed(12)
    cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "M_FASTEST": m_fastest}
    run_dense(2, 100, 90, 6, 2, 64, torch.float32, True, 10, 0, config=cfg)


def test_launch_config_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table's rules (kernels/prefill.py), as on a GPU: the tile config by dtype, head_dim
    and query length; the grid order by the K/V bytes of one KV head."""
    if P._INTERPRET:
        assert launch_config(128, torch.bfloat16, True, 4096, 65536)["BLOCK_M"] == 64  # its one config
    monkeypatch.setattr(P, "_INTERPRET", False)
    assert not launch_config(128, torch.bfloat16, True, 16384, 16384)["M_FASTEST"]  # 8 MiB per KV head
    assert launch_config(128, torch.bfloat16, False, 16384, 16384)["M_FASTEST"]
    assert launch_config(128, torch.bfloat16, False, 4096, 4096)["M_FASTEST"]  # unmasked: always
    assert launch_config(128, torch.bfloat16, True, 16384, 32768)["M_FASTEST"]     # 16 MiB
    assert launch_config(64, torch.bfloat16, True, 16384, 65536)["M_FASTEST"]     # 16 MiB at D=64
    assert not launch_config(64, torch.bfloat16, True, 16384, 32768)["M_FASTEST"]
    assert launch_config(128, torch.float16, True, 4096, 4096) == P._config_dict(P._HALF, False)
    assert launch_config(128, torch.float16, True, 64, 4096) == P._config_dict(P._HALF_SHORT_Q, False)
    assert launch_config(256, torch.float16, True, 64, 4096) == P._config_dict(P._D256, False)
    assert launch_config(128, torch.float32, True, 4096, 4096) == P._config_dict(P._FP32, False)
    assert launch_config(256, torch.float32, True, 4096, 4096) == P._config_dict(P._FP32_D256, False)
    # a head_dim that is not a power of two: its tile's config
    for d, dtype, cfg in ((96, torch.bfloat16, P._HALF), (192, torch.bfloat16, P._D256),
                          (192, torch.float32, P._FP32_D256)):
        assert launch_config(d, dtype, True, 4096, 4096) == P._config_dict(cfg, False)
    # the register cap on sm_90+ only (an A100 spills under it: tests/test_compile_targets.py)
    assert launch_config(128, torch.bfloat16, True, 4096, 4096, capability=(9, 0))["maxnreg"] == 128
    sm80 = launch_config(128, torch.bfloat16, True, 4096, 4096, capability=(8, 0))
    assert "maxnreg" not in sm80 and sm80["num_warps"] == 8 and sm80["BLOCK_M"] == 128


# Every config the launch table can choose, with the dtypes and head dims it chooses it for.
# (A head_dim that is not a power of two takes its tile's config: one such per config.)
TABLE = [(P._HALF, "half", (64, 128, 96)), (P._HALF_SHORT_Q, "half", (64, 128, 80)),
         (P._D256, "half", (256, 192)), (P._FP32, "fp32", (64, 128, 40)),
         (P._FP32_D256, "fp32", (256, 192)), (P._FP8_HALF, "half", (64, 128)),
         (P._FP8_D256, "half", (256,))]
assert {c for c, _, _ in TABLE} == set(LAUNCH_CONFIGS)


@pytest.mark.gpu
@pytest.mark.parametrize("m_fastest", [False, True])
@pytest.mark.parametrize("cfg,kind,dims", TABLE,
                         ids=[f"{'x'.join(map(str, c[:4]))}-{k}-d{'/'.join(map(str, d))}" for c, k, d in TABLE])
def test_every_launch_config(cfg: tuple, kind: str, dims: tuple[int, ...], m_fastest: bool) -> None:
    """Every config the launch table can choose, in both grid orders, is exact (not only the
    ones the benchmark's shapes happen to pick)."""
    config = P._config_dict(cfg, m_fastest)
    torch.manual_seed(5)
    for d in dims:
        for dtype in (HALF if kind == "half" else [torch.float32]):
            # causal with a query offset and ragged tails; non-causal rectangular; square causal
            run_dense(2, 300, 1000, 4, 2, d, dtype, True, 700, 0, config=config)
            run_dense(1, 257, 383, 3, 1, d, dtype, False, 0, 0, config=config)
            run_dense(1, 384, 384, 2, 2, d, dtype, True, 0, 0, config=config)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_noncontiguous_inputs() -> None:
    """q/k/v as strided views of a packed qkv tensor."""
    torch.manual_seed(5)
    b, s, hq, hkv, d = 2, 50, 4, 2, 64
    qkv = rand(b, s, hq + 2 * hkv, d)
    q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
    o, lse = flash_attention_fwd(q, k, v, softmax_scale=0.1, causal=True, q_start=0, k_start=0)
    for i in range(b):
        o_ref, lse_ref = ref_seq(q[i], k[i], v[i], 0.1, True, 0, 0)
        check(o[i], lse[i], o_ref, lse_ref, torch.float32)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_empty_kv() -> None:
    q = rand(1, 5, 2, 64)
    k = rand(1, 0, 1, 64)
    o, lse = flash_attention_fwd(q, k, k, softmax_scale=0.125, causal=False, q_start=0, k_start=0)
    assert (o == 0).all() and torch.isneginf(lse).all()
    assert lse.shape == (1, 5, 2)


# --------------------------------------------------------------------------- #
# Varlen
# --------------------------------------------------------------------------- #
def run_varlen(lens_q: list[int], lens_k: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype,
               causal: bool, q_start, k_start) -> None:
    cu_q = ints([0] + torch.tensor(lens_q).cumsum(0).tolist(), torch.int32)
    cu_k = ints([0] + torch.tensor(lens_k).cumsum(0).tolist(), torch.int32)
    q = rand(int(cu_q[-1]), hq, d, dtype=dtype)
    k = rand(int(cu_k[-1]), hkv, d, dtype=dtype)
    v = rand(int(cu_k[-1]), hkv, d, dtype=dtype)
    scale = d ** -0.5
    qs_arg = ints(q_start, torch.int32) if isinstance(q_start, list) else q_start
    ks_arg = ints(k_start, torch.int32) if isinstance(k_start, list) else k_start
    o, lse = flash_attention_fwd(q, k, v, softmax_scale=scale, causal=causal, q_start=qs_arg,
                                 k_start=ks_arg, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    assert o.shape == q.shape and lse.shape == (q.shape[0], hq)
    for i in range(len(lens_q)):
        a, e = int(cu_q[i]), int(cu_q[i + 1])
        ka, ke = int(cu_k[i]), int(cu_k[i + 1])
        qs = q_start[i] if isinstance(q_start, list) else q_start
        ks = k_start[i] if isinstance(k_start, list) else k_start
        o_ref, lse_ref = ref_seq(q[a:e], k[ka:ke], v[ka:ke], scale, causal, qs, ks)
        oh = torch_half_seq(q[a:e], k[ka:ke], v[ka:ke], scale, causal, qs, ks) \
            if dtype != torch.float32 else None
        check(o[a:e], lse[a:e], o_ref, lse_ref, dtype, oh)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32] + HALF)
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_self(causal: bool, dtype: torch.dtype) -> None:
    """Self-attention prefill: equal q/k lengths including 1."""
    torch.manual_seed(21)
    lens = [1, 37, 130, 64, 1]
    run_varlen(lens, lens, 4, 2, 64, dtype, causal, 0, 0)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_varlen_offsets() -> None:
    """Chunked prefill: new queries at the end of a cached context, per-sequence offsets."""
    torch.manual_seed(22)
    lens_q = [1, 20, 70]
    lens_k = [50, 20, 100]
    # seq0: decode-like single query at the end; seq1: q before k (some empty rows);
    # seq2: queries are the last 70 of the 100 keys.
    run_varlen(lens_q, lens_k, 3, 1, 64, torch.float32, True, [49, 0, 30], [0, 10, 0])


# --------------------------------------------------------------------------- #
# Merge consistency (what ring / context-parallel attention relies on)
# --------------------------------------------------------------------------- #
def merge_f64(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial (o [B, Sq, Hq, D], lse [B, Sq, Hq]) results with the merge layer, in float64."""
    os_ = torch.stack([p[0].cpu().double() for p in parts])  # [C, B, Sq, Hq, D]
    ls = torch.stack([p[1].cpu().double() for p in parts])   # [C, B, Sq, Hq]
    return longctx.merge_states(os_, ls)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("n_chunks", [2, 3, 5])
@pytest.mark.parametrize("causal", [True, False])
def test_merge_chunks(n_chunks: int, causal: bool) -> None:
    torch.manual_seed(30 + n_chunks)
    b, sq, sk, hq, hkv, d = 1, 60, 150, 2, 1, 64
    q_start, k_start = 100, 0  # queries = positions 100..159, keys 0..149 (last 10 rows see all)
    q, k, v = rand(b, sq, hq, d), rand(b, sk, hkv, d), rand(b, sk, hkv, d)
    kw = dict(softmax_scale=d ** -0.5, causal=causal, q_start=q_start)
    full_o, full_lse = (t.cpu() for t in flash_attention_fwd(q, k, v, k_start=k_start, **kw))
    bounds = torch.linspace(0, sk, n_chunks + 1).round().long().tolist()
    parts = [flash_attention_fwd(q, k[:, a:e], v[:, a:e], k_start=k_start + a, **kw)
             for a, e in zip(bounds[:-1], bounds[1:])]
    o, lse = merge_f64(parts)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(full_lse))
    fin = ~torch.isneginf(lse)
    assert (o - full_o.double()).abs().max() < FP32_TOL
    assert (lse[fin] - full_lse.double()[fin]).abs().max() < FP32_TOL
    o_ref, lse_ref = ref_seq(q[0], k[0], v[0], d ** -0.5, causal, q_start, k_start)
    assert (o[0] - o_ref).abs().max() < FP32_TOL


@pytest.mark.gpu
@pytest.mark.interpreter
def test_merge_with_empty_rows() -> None:
    """Queries before part of the KV: future chunks are entirely empty (-inf) and must merge away."""
    torch.manual_seed(40)
    b, sq, sk, hq, d = 1, 64, 128, 2, 64
    q, k, v = rand(b, sq, hq, d), rand(b, sk, 1, d), rand(b, sk, 1, d)
    kw = dict(softmax_scale=0.125, causal=True, q_start=20)
    full_o, full_lse = (t.cpu() for t in flash_attention_fwd(q, k, v, k_start=30, **kw))
    parts = [flash_attention_fwd(q, k[:, a:a + 32], v[:, a:a + 32], k_start=30 + a, **kw)
             for a in range(0, sk, 32)]
    o, lse = merge_f64(parts)
    empty = torch.isneginf(full_lse)
    assert empty.any() and torch.equal(torch.isneginf(lse), empty)
    assert (o - full_o.double()).abs().max() < FP32_TOL
    assert (lse[~empty] - full_lse.double()[~empty]).abs().max() < FP32_TOL


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("m_fastest", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32] + HALF)
@pytest.mark.parametrize("causal", [True, False])
def test_accumulate_chunks(causal: bool, dtype: torch.dtype, m_fastest: bool) -> None:
    """The kernel's fused merge (accumulate=): K/V in 4 uneven chunks folded into one running
    state equals attention over the whole K/V; GQA group 3, two sequences with per-sequence
    offsets. Causal: sequence 1's first rows see no key at all (they stay empty) and its last
    chunk lies entirely in its queries' future. The accumulator starts as NaN with LSE -inf:
    the kernel must never read O where the state is empty."""
    run_accumulate_chunks(causal, dtype, m_fastest, 64)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32] + HALF)
@pytest.mark.parametrize("d", [40, 96])
def test_accumulate_chunks_head_dim_not_power_of_two(d: int, dtype: torch.dtype) -> None:
    """The fused merge at a padded head_dim: the padding columns of the accumulator's rows are
    the next heads' columns, so the epilogue must neither read nor write them."""
    run_accumulate_chunks(True, dtype, False, d)


def run_accumulate_chunks(causal: bool, dtype: torch.dtype, m_fastest: bool, d: int) -> None:
    """`test_accumulate_chunks` at head_dim d."""
    torch.manual_seed(60)
    b, sq, sk, hq, hkv, k0 = 2, 70, 150, 3, 1, 10
    q, k, v = rand(b, sq, hq, d, dtype=dtype), rand(b, sk, hkv, d, dtype=dtype), rand(b, sk, hkv, d, dtype=dtype)
    q_start = ints([40, 5], torch.int64)  # sequence 1: rows 0..4 precede key 0 (at position 10)
    kw = dict(softmax_scale=d ** -0.5, causal=causal, q_start=q_start)
    cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "M_FASTEST": m_fastest}
    o_acc = torch.full((b, sq, hq, d), float("nan"), dtype=torch.float32, device=DEVICE)
    lse_acc = torch.full((b, sq, hq), float("-inf"), dtype=torch.float32, device=DEVICE)
    for a, e in [(0, 30), (30, 31), (31, 120), (120, 150)]:
        out = flash_attention_fwd(q, k[:, a:e], v[:, a:e], k_start=k0 + a, accumulate=(o_acc, lse_acc),
                                  _config=cfg, **kw)
        assert out is None
    for i in range(b):
        o_ref, lse_ref = ref_seq(q[i], k[i], v[i], d ** -0.5, causal, int(q_start[i]), k0)
        lse_i = lse_acc[i]
        empty = torch.isneginf(lse_ref)
        assert empty.any() == (causal and i == 1)
        assert torch.equal(torch.isneginf(lse_i.cpu()), empty)
        assert (o_acc[i].cpu()[empty] == 0).all()
        oh = torch_half_seq(q[i], k[i], v[i], d ** -0.5, causal, int(q_start[i]), k0) \
            if dtype != torch.float32 else None
        check(o_acc[i], lse_i, o_ref, lse_ref, torch.float32 if oh is None else dtype, oh)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_accumulate_public_api_and_checks() -> None:
    """longctx.attention_merge_into on the kernel path equals attention + merge_into; bad
    accumulators raise ValueError naming them."""
    torch.manual_seed(61)
    q, k, v = rand(1, 33, 4, 64), rand(1, 40, 2, 64), rand(1, 40, 2, 64)
    o1 = torch.zeros(1, 33, 4, 64, device=DEVICE)
    l1 = torch.full((1, 33, 4), float("-inf"), device=DEVICE)
    o2, l2 = o1.clone(), l1.clone()
    with force_triton(DEVICE == "cpu"):
        for a, e in [(0, 17), (17, 40)]:
            longctx.attention_merge_into(o1, l1, q, k[:, a:e], v[:, a:e], causal=True,
                                         q_start=7, k_start=a)
            o, lse = longctx.attention(q, k[:, a:e], v[:, a:e], causal=True, q_start=7,
                                       k_start=a, return_lse=True)
            longctx.merge_into(o2, l2, o, lse)
    assert (o1 - o2).abs().max() < FP32_TOL and (l1 - l2).abs().max() < FP32_TOL
    kw = dict(softmax_scale=0.125, causal=False, q_start=0, k_start=0)
    with pytest.raises(ValueError, match="o_acc and lse_acc must both be float32"):
        flash_attention_fwd(q, k, v, accumulate=(o1.half(), l1), **kw)
    with pytest.raises(ValueError, match="o_acc .* and lse_acc .* must be shaped like q"):
        flash_attention_fwd(q, k, v, accumulate=(o1[:, :5], l1[:, :5]), **kw)
    with pytest.raises(ValueError, match="o_acc .* and lse_acc .* must be shaped like q"):
        longctx.attention_merge_into(o1[:, :5], l1, q, k, v)
    with pytest.raises(ValueError, match="must both be float32"):
        longctx.attention_merge_into(o1, l1.double(), q, k, v)
    with pytest.raises(ValueError, match="unit stride"):
        longctx.attention_merge_into(o1.transpose(-1, -2).contiguous().transpose(-1, -2), l1, q, k, v)
    with pytest.raises(ValueError, match="device"):
        longctx.attention_merge_into(o1.to("meta"), l1, q, k, v)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("sq,sk,q_start,k_start", [(40, 128, 0, 0), (16, 128, 20, 0), (30, 120, 100, 64)])
def test_fully_masked_tiles_skipped(sq: int, sk: int, q_start: int, k_start: int) -> None:
    """K/V tiles that no row of the tile can see are never loaded: poison them with NaN."""
    torch.manual_seed(50)
    bn = 16
    q = rand(1, sq, 2, 64)
    k, v = rand(1, sk, 1, 64), rand(1, sk, 1, 64)
    last_visible = q_start + sq - 1 - k_start
    first_dead = (last_visible // bn + 1) * bn
    assert first_dead < sk
    k[:, first_dead:] = float("nan")
    v[:, first_dead:] = float("nan")
    o, lse = flash_attention_fwd(q, k, v, softmax_scale=0.125, causal=True, q_start=q_start,
                                 k_start=k_start, _config={"BLOCK_M": 16, "BLOCK_N": bn})
    o_ref, lse_ref = ref_seq(q[0], k[0, :first_dead], v[0, :first_dead], 0.125, True, q_start, k_start)
    check(o[0], lse[0], o_ref, lse_ref, torch.float32)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_large_positions() -> None:
    """Absolute positions beyond int32 (python ints and int64 tensors)."""
    torch.manual_seed(60)
    base = 3 * 2**31
    run_dense(1, 40, 70, 2, 1, 64, torch.float32, True, base + 30, base)
    q = rand(2, 40, 2, 64)
    k, v = rand(2, 70, 1, 64), rand(2, 70, 1, 64)
    qs = ints([base + 30, 5], torch.int64)
    ks = ints([base, base], torch.int64)  # seq 1: keys far in the future -> empty
    o, lse = flash_attention_fwd(q, k, v, softmax_scale=0.125, causal=True, q_start=qs, k_start=ks)
    for i in range(2):
        o_ref, lse_ref = ref_seq(q[i], k[i], v[i], 0.125, True, int(qs[i]), int(ks[i]))
        check(o[i], lse[i], o_ref, lse_ref, torch.float32)
    assert torch.isneginf(lse[1]).all()


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("d", [64, 96])
def test_public_attention_dispatches_to_the_kernel(d: int) -> None:
    """longctx.attention on the Triton path (forced on CPU) agrees with the reference path."""
    torch.manual_seed(60)
    q, k, v = rand(2, 33, 6, d), rand(2, 47, 2, d), rand(2, 47, 2, d)
    with force_triton(DEVICE == "cpu"):
        o, lse = longctx.attention(q, k, v, causal=True, q_start=20, return_lse=True)
    ro, rlse = reference_attention(q.cpu(), k.cpu(), v.cpu(), causal=True, q_start=20,
                                   compute_dtype=torch.float64)
    assert (o.cpu().double() - ro).abs().max() < FP32_TOL
    fin = ~torch.isneginf(rlse)
    assert torch.equal(torch.isneginf(lse.cpu()), ~fin)
    assert (lse.cpu().double()[fin] - rlse[fin]).abs().max() < FP32_TOL
