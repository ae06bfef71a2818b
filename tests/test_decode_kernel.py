"""Kernel-level tests of longctx.kernels.decode.flash_decode_partials: every split's state
(empty splits exactly O = 0 / LSE = -inf), the merged result against the float64 reference,
paged caches with shared pages, many group sizes and head dims. Runs under the Triton
interpreter on CPU, compiled on a GPU."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import triton
import triton.language as tl

import longctx.kernels.decode as decode_mod
import longctx.kernels.utils as kernel_utils
from longctx import merge_states
from longctx.kernels.decode import (
    _MAX_BLOCK_H, FP8_SPLITS, _launch_config, _split_launch, choose_num_splits, flash_decode,
    flash_decode_partials, fused_counters,
)
from longctx.reference import reference_attention
from tests.env import DEVICE



def merge_partials_f64(o_part: torch.Tensor, lse_part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge layer in float64. o_part [S,B,H,D], lse_part [S,B,H] -> o [B,H,D], lse [B,H]."""
    return merge_states(o_part.double(), lse_part.double())


def reference(q, k_log, v_log, seqlens, scale, dtype=torch.float64):
    """Attention over logical caches k_log/v_log [B,S,Hkv,D], computed in `dtype` (a half dtype
    gives the plain PyTorch implementation). Returns o [B,Hq,D] and lse [B,Hq]; empty
    sequences give o = 0, lse = -inf."""
    o, lse = reference_attention(q[:, None], k_log, v_log, softmax_scale=scale,
                                 seqlens_k=seqlens, compute_dtype=dtype)
    return o[:, 0], lse[:, 0].double()


def split_ranges(L: int, num_splits: int, block_n: int) -> list[tuple[int, int]]:
    """Host mirror of the in-kernel split computation."""
    chunk = -(-(-(-L // num_splits)) // block_n) * block_n
    return [(s * chunk, min(s * chunk + chunk, L)) for s in range(num_splits)]


def make_paged(k_log, v_log, page_size, gen, share_first_page=False):
    """Scatter logical caches [B,S,Hkv,D] into shuffled pages. Returns (k_pages, v_pages, block_table).

    With share_first_page, sequence 1 reuses sequence 0's first page (its logical
    content is then overwritten accordingly by the caller via gather_logical).
    """
    B, S, Hkv, D = k_log.shape
    max_pages = -(-S // page_size)
    n_pages = B * max_pages + 3  # a few unused pages
    perm = torch.randperm(n_pages, generator=gen)[: B * max_pages].view(B, max_pages).to(torch.int32)
    if share_first_page and B > 1:
        perm[1, 0] = perm[0, 0]
    k_pages = torch.randn(n_pages, page_size, Hkv, D, generator=gen, dtype=torch.float64).to(k_log.dtype)
    v_pages = torch.randn(n_pages, page_size, Hkv, D, generator=gen, dtype=torch.float64).to(v_log.dtype)
    pad = max_pages * page_size - S
    kp = torch.nn.functional.pad(k_log, (0, 0, 0, 0, 0, pad)).view(B, max_pages, page_size, Hkv, D)
    vp = torch.nn.functional.pad(v_log, (0, 0, 0, 0, 0, pad)).view(B, max_pages, page_size, Hkv, D)
    for b in range(B):
        for j in range(max_pages):
            if share_first_page and b == 1 and j == 0:
                continue  # shared page keeps sequence 0's content
            k_pages[perm[b, j]] = kp[b, j]
            v_pages[perm[b, j]] = vp[b, j]
    return k_pages, v_pages, perm


def gather_logical(pages, block_table, S):
    """Logical view [B,S,Hkv,D] of a paged cache (the ground truth for paged tests)."""
    B, P = block_table.shape
    page_size = pages.shape[1]
    rows = pages[block_table.long()]  # [B,P,ps,Hkv,D]
    return rows.reshape(B, P * page_size, *pages.shape[2:])[:, :S]


def check(q, k_cache, v_cache, seqlens, block_table, scale, num_splits, k_log, v_log, dtype):
    """Run the kernel, check empty-split states exactly, and compare merged result to float64."""
    o_part, lse_part = flash_decode_partials(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), seqlens.to(DEVICE),
        None if block_table is None else block_table.to(DEVICE), scale, num_splits,
    )
    o_part, lse_part = o_part.cpu(), lse_part.cpu()
    B, Hq, D = q.shape
    assert o_part.shape == (num_splits, B, Hq, D) and o_part.dtype == torch.float32
    assert lse_part.shape == (num_splits, B, Hq) and lse_part.dtype == torch.float32

    G = Hq // k_cache.shape[2]
    capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    bn, _, _ = _launch_config(D, k_cache.dtype, min(max(16, triton.next_power_of_2(G)), _MAX_BLOCK_H),
                              triton.cdiv(capacity, num_splits), torch.device(DEVICE))
    for b in range(B):
        for s, (lo, hi) in enumerate(split_ranges(int(seqlens[b]), num_splits, bn)):
            if lo >= hi:
                assert torch.all(lse_part[s, b] == -math.inf), (b, s)
                assert torch.all(o_part[s, b] == 0), (b, s)
            else:
                assert torch.isfinite(lse_part[s, b]).all(), (b, s)
                assert torch.isfinite(o_part[s, b]).all(), (b, s)

    o, lse = merge_partials_f64(o_part, lse_part)
    o_ref, lse_ref = reference(q, k_log, v_log, seqlens, scale)
    empty = seqlens == 0
    assert torch.all(lse[empty] == -math.inf) and torch.all(o[empty] == 0)
    ne = ~empty
    if not ne.any():
        return
    err = (o[ne] - o_ref[ne]).abs().max().item()
    lse_err = (lse[ne] - lse_ref[ne]).abs().max().item()
    if dtype == torch.float32:
        assert err < 1e-4, err
        assert lse_err < 1e-4, lse_err
    else:
        # Baseline: the same attention done naively in torch at the input dtype.
        o_t, _ = reference(q, k_log, v_log, seqlens, scale, dtype=dtype)
        err_t = (o_t[ne].double() - o_ref[ne]).abs().max().item()
        assert err <= 2 * err_t + 2e-3, (err, err_t)
        assert lse_err < 5e-3, lse_err


def make_inputs(B, Hkv, G, D, S, dtype, gen):
    q = torch.randn(B, Hkv * G, D, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(B, S, Hkv, D, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(B, S, Hkv, D, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v


# ----------------------------------------------------------------------------- tests
# (seqlens, Hkv, G, D): ragged lengths incl. 0, 1, 17, 1000 and non-multiples of BLOCK_N.
CASES = [
    ([17], 2, 1, 64),
    ([1000, 0, 1], 1, 3, 128),
    ([0, 70, 129], 2, 8, 64),
    ([130, 1, 17], 1, 8, 128),
]


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_splits", [1, 3, 64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"L{c[0]}-hkv{c[1]}-g{c[2]}-d{c[3]}")
def test_contiguous(case, num_splits, dtype):
    lens, Hkv, G, D = case
    gen = torch.Generator().manual_seed(hash((tuple(lens), num_splits)) % 2**31)
    B, S = len(lens), max(max(lens), 1) + 5
    q, k, v = make_inputs(B, Hkv, G, D, S, dtype, gen)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    check(q, k, v, seqlens, None, D ** -0.5, num_splits, k, v, dtype)


PAGED_CASES = [
    ([1000, 17, 0], 1, 3, 64, 16),
    ([45, 1, 200], 2, 8, 128, 32),
    ([33, 64], 1, 1, 128, 16),
    ([300, 100], 1, 8, 64, 128),  # BLOCK_N <= page_size: one table lookup per block
]


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_splits", [1, 3, 64])
@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: f"L{c[0]}-hkv{c[1]}-g{c[2]}-d{c[3]}-ps{c[4]}")
def test_paged(case, num_splits, dtype):
    lens, Hkv, G, D, ps = case
    gen = torch.Generator().manual_seed(hash((tuple(lens), num_splits, ps)) % 2**31)
    B, S = len(lens), max(lens) + 3
    q, k_log, v_log = make_inputs(B, Hkv, G, D, S, dtype, gen)
    k_pages, v_pages, bt = make_paged(k_log, v_log, ps, gen, share_first_page=True)
    # Ground truth from the page table itself (covers the shared page).
    k_log = gather_logical(k_pages, bt, S)
    v_log = gather_logical(v_pages, bt, S)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    check(q, k_pages, v_pages, seqlens, bt, D ** -0.5, num_splits, k_log, v_log, dtype)


FUSED_CASES = [  # (seqlens, Hkv, G, D, page size or None)
    ([17], 2, 1, 64, None),
    ([1000, 0, 1], 1, 3, 128, None),
    ([0, 70, 129], 2, 8, 64, None),
    ([45, 1, 200], 2, 6, 64, 32),
    ([41], 1, 80, 32, None),  # two head blocks (64 + 16 rows) per KV head
]


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_splits", [2, 5, 64])
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"L{c[0]}-hkv{c[1]}-g{c[2]}-d{c[3]}-ps{c[4]}")
def test_fused_merge(case, num_splits, dtype):
    """The split kernel's own merge (its last program per group) gives the separate merge
    kernel's output up to the order of its sums (they load different numbers of splits at
    once), within the tolerance of the float64 reference, and leaves its arrival counters
    zero, so the next launch can reuse them."""
    run_fused_merge(case, num_splits, dtype)


# head_dims that are not powers of two: two power-of-two column tiles where they split (96, 80,
# 192: kernels.utils.head_tiles), else the tile of the next one with its padding columns masked
# (40, 72). (seqlens, Hkv, G, D, page size or None); GQA 5 and 3, empty and 1-key sequences.
ODD_HEAD_DIM_CASES = [
    ([100, 0, 1], 1, 5, 96, None),
    ([17, 40], 2, 3, 40, None),
    ([70, 1, 0], 1, 5, 80, 16),
    ([45], 1, 3, 192, 32),
    ([33, 70], 1, 3, 72, 16),
]


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_splits", [1, 6])  # 6: more splits than any sequence's key blocks
@pytest.mark.parametrize("case", ODD_HEAD_DIM_CASES,
                         ids=lambda c: f"L{c[0]}-hkv{c[1]}-g{c[2]}-d{c[3]}-ps{c[4]}")
def test_head_dim_not_power_of_two(case, num_splits, dtype):
    """Every split's state (empty splits exactly empty) and their merge against float64,
    contiguous and paged caches."""
    lens, Hkv, G, D, ps = case
    gen = torch.Generator().manual_seed(hash((tuple(lens), num_splits, D)) % 2**31)
    B, S = len(lens), max(lens) + 3
    q, k_log, v_log = make_inputs(B, Hkv, G, D, S, dtype, gen)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    if ps is None:
        check(q, k_log, v_log, seqlens, None, D ** -0.5, num_splits, k_log, v_log, dtype)
    else:
        k, v, bt = make_paged(k_log, v_log, ps, gen)
        check(q, k, v, seqlens, bt, D ** -0.5, num_splits, gather_logical(k, bt, S),
              gather_logical(v, bt, S), dtype)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("case", [ODD_HEAD_DIM_CASES[0], ODD_HEAD_DIM_CASES[3]],
                         ids=lambda c: f"L{c[0]}-hkv{c[1]}-g{c[2]}-d{c[3]}-ps{c[4]}")
def test_head_dim_padded_tile(case, monkeypatch):
    """Head_dims that split by default (96, 192), on the padded tile (SPLIT_HEADS off: the A/B
    of bench/decode_head_split.py), fp16, 6 splits, fused merge too."""
    lens, Hkv, G, D, ps = case
    gen = torch.Generator().manual_seed(hash((tuple(lens), D, "padded")) % 2**31)
    B, S = len(lens), max(lens) + 3
    q, k_log, v_log = make_inputs(B, Hkv, G, D, S, torch.float16, gen)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    for split, tiles in ((True, (D // 3 * 2, D // 3)), (False, (triton.next_power_of_2(D), 0))):
        monkeypatch.setattr(decode_mod, "SPLIT_HEADS", split)
        launch = _split_launch(q, k_log, v_log, seqlens, None, 1.0, 6, torch.float32)
        assert (launch.kwargs["BLOCK_D"], launch.kwargs["D_HI"]) == tiles
    if ps is None:
        check(q, k_log, v_log, seqlens, None, D ** -0.5, 6, k_log, v_log, torch.float16)
    else:
        k, v, bt = make_paged(k_log, v_log, ps, gen)
        check(q, k, v, seqlens, bt, D ** -0.5, 6, gather_logical(k, bt, S),
              gather_logical(v, bt, S), torch.float16)
    run_fused_merge(case, 5, torch.float16)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("case", [ODD_HEAD_DIM_CASES[0], ODD_HEAD_DIM_CASES[4]],
                         ids=lambda c: f"L{c[0]}-hkv{c[1]}-g{c[2]}-d{c[3]}-ps{c[4]}")
def test_fused_merge_head_dim_not_power_of_two(case, num_splits, dtype):
    """`test_fused_merge` at head_dims 96 and 72 (5 splits: more than the key blocks)."""
    run_fused_merge(case, num_splits, dtype)


@triton.jit
def _tile_starts_kernel(X, OUT, BLOCK_D: tl.constexpr, D_HI: tl.constexpr):
    lo, hi = decode_mod._split_head_tiles(X, BLOCK_D, D_HI, True)
    tl.store(OUT, lo)
    tl.store(OUT + 1, hi)


def at_line_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of t on DEVICE whose first element lies `offset` bytes into a 128-byte line."""
    es = t.element_size()
    buf = torch.empty(t.numel() + 128 // es, dtype=t.dtype, device=DEVICE)
    start = (offset - buf.data_ptr()) % 128 // es
    out = buf[start:start + t.numel()].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 128 == offset
    return out


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("D, dtype, swapped_at", [
    (96, torch.float16, 64),  # 64 + 32: a head 64 bytes into a line takes its 32 first
    (160, torch.float16, 64),  # 128 + 32
    (80, torch.float16, 96),  # 64 + 16: 96 bytes in, the 16 columns end the line
    (96, torch.float32, None),  # 32 columns of 4 bytes are a line: every order covers lines
], ids=lambda x: str(x).replace("torch.", ""))
def test_split_head_tiles_follow_the_line(D, dtype, swapped_at):
    """`_split_head_tiles`: a split head's narrow tile comes first exactly where that puts the
    wide tile on whole 128-byte lines."""
    block_d, d_hi = kernel_utils.head_tiles(D)
    for offset in range(0, 128, 16):
        x = at_line_offset(torch.zeros(8, dtype=dtype), offset)
        out = torch.full((2,), -1, dtype=torch.int32, device=DEVICE)
        _tile_starts_kernel[(1,)](x, out, block_d, d_hi, **kernel_utils.FP_FUSION)
        want = [d_hi, 0] if offset == swapped_at else [0, block_d]
        assert out.tolist() == want, (offset, out.tolist())


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
# (0, 0): head 0 in line, head 1 64 bytes in (both its tiles reordered); (64, 0): K's head 0
# and V's head 1 reordered, not the others; (32, 96): no head where reordering helps
@pytest.mark.parametrize("offsets", [(0, 0), (64, 0), (32, 96)], ids=lambda o: f"k{o[0]}-v{o[1]}")
def test_split_head_at_any_line_offset(offsets, paged):
    """96 = 64 + 32 columns, fp16, 2 KV heads (a row 3 lines long: head 1 starts 64 bytes into
    a line), K and V starting at the given byte offsets into a line: each program orders its
    K and V tiles apart (`_split_head_tiles`), and the splits (1 and 5, empty ones exact), their
    merge and the fused merge give the float64 reference's output within the 2x rule."""
    lens, Hkv, G, D, ps = [70, 1, 0], 2, 3, 96, 16
    gen = torch.Generator().manual_seed(hash((offsets, paged)) % 2**31)
    B, S = len(lens), max(lens) + 3
    q, k_log, v_log = make_inputs(B, Hkv, G, D, S, torch.float16, gen)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    k, v, bt = (k_log, v_log, None) if not paged else make_paged(k_log, v_log, ps, gen)
    if paged:
        k_log, v_log = gather_logical(k, bt, S), gather_logical(v, bt, S)
    k, v = at_line_offset(k, offsets[0]), at_line_offset(v, offsets[1])
    assert _split_launch(q, k, v, seqlens, bt, 1.0, 5, torch.float32).kwargs["ALIGN_TILES"]
    for num_splits in (1, 5):
        check(q, k, v, seqlens, bt, D ** -0.5, num_splits, k_log, v_log, torch.float16)
    sl, qd = seqlens.to(DEVICE), q.to(DEVICE)
    btd = None if bt is None else bt.to(DEVICE)
    o_sep, _ = flash_decode(qd, k, v, sl, btd, D ** -0.5, 5, merge="separate")
    o_fused, _ = flash_decode(qd, k, v, sl, btd, D ** -0.5, 5, merge="fused")
    torch.testing.assert_close(o_fused, o_sep)


def run_fused_merge(case, num_splits, dtype):
    """`test_fused_merge` for one case: (seqlens, Hkv, G, D, page size or None)."""
    lens, Hkv, G, D, ps = case
    gen = torch.Generator().manual_seed(hash((tuple(lens), num_splits, G)) % 2**31)
    B, S = len(lens), max(lens) + 3
    q, k_log, v_log = make_inputs(B, Hkv, G, D, S, dtype, gen)
    k, v, bt = (k_log, v_log, None) if ps is None else make_paged(k_log, v_log, ps, gen)
    if bt is not None:
        k_log, v_log = gather_logical(k, bt, S), gather_logical(v, bt, S)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    q, k, v, sl = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), seqlens.to(DEVICE)
    bt = None if bt is None else bt.to(DEVICE)
    o_sep, lse_sep = flash_decode(q, k, v, sl, bt, D ** -0.5, num_splits, merge="separate")
    launch = _split_launch(q, k, v, sl, bt, D ** -0.5, num_splits, torch.float32,
                           fused_merge=True)
    counters = torch.zeros(fused_counters(q, k), dtype=torch.int32, device=DEVICE)
    o_part = torch.empty(num_splits, B, Hkv * G, D, device=DEVICE)
    lse_part = torch.empty(num_splits, B, Hkv * G, device=DEVICE)
    for _ in range(2):  # the second launch finds the counters zero again
        o, lse = torch.full_like(o_sep, float("nan")), torch.full_like(lse_sep, float("nan"))
        launch.generic(q, k, v, sl, sl if bt is None else bt, o_part, lse_part, o, lse, counters,
                       lse, lse, lse, lse)  # (scales and means: unused without an fp8 cache)
        assert not counters.any()
        torch.testing.assert_close(o, o_sep)  # dtype-dependent tolerances: a rounding or two
        torch.testing.assert_close(lse, lse_sep, atol=1e-6, rtol=1e-6)
    o_ref, lse_ref = reference(q.cpu(), k_log, v_log, seqlens, D ** -0.5)
    o_t, _ = reference(q.cpu(), k_log, v_log, seqlens, D ** -0.5, dtype=dtype)
    ne = seqlens > 0
    err = (o.cpu().double() - o_ref)[ne].abs().max().item()
    err_t = (o_t.double() - o_ref)[ne].abs().max().item()
    assert err <= (1e-5 if dtype == torch.float32 else 2 * err_t + 2e-3), (err, err_t)
    assert torch.all(lse.cpu()[~ne] == -math.inf) and torch.all(o.cpu()[~ne] == 0)


def test_fuse_merge_rule(monkeypatch):
    """"auto" fuses the merge up to FUSED_MERGE_MAX_SPLITS splits (measured: beyond, the separate
    kernel is faster); "fused" / "separate" and LONGCTX_DECODE_MERGE's value override it."""
    import longctx.kernels.decode as kd

    limit = kd.FUSED_MERGE_MAX_SPLITS
    assert kd.fuse_merge(2) and kd.fuse_merge(limit) and not kd.fuse_merge(limit + 1)
    assert kd.fuse_merge(64, "fused") and not kd.fuse_merge(2, "separate")
    monkeypatch.setattr(kd, "DECODE_MERGE", "separate")
    assert not kd.fuse_merge(2) and kd.fuse_merge(64, "fused")
    monkeypatch.setattr(kd, "DECODE_MERGE", "fused")
    assert kd.fuse_merge(64)
    with pytest.raises(ValueError, match="merge"):
        kd.fuse_merge(2, "sometimes")
    q, k = torch.randn(1, 4, 16), torch.randn(1, 64, 2, 16)
    monkeypatch.setattr(kd, "DECODE_MERGE", "auto")
    for splits, fused in ((1, False), (limit, True), (limit + 1, False)):
        plan = kd.DecodePlan(q, k, k, None, None, 0.25, splits, False)
        assert (plan.counters > 0) == fused and (plan.merge is None) == (splits == 1 or fused)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_group16_and_strided_q():
    """G=16 (BLOCK_H == G), non-contiguous q ([Hq,B,D] transposed) and a non-default scale."""
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float32
    B, Hkv, G, D, S = 2, 1, 16, 64, 90
    q_t = torch.randn(Hkv * G, B, D, generator=gen, dtype=torch.float64).to(dtype)
    q = q_t.transpose(0, 1)  # strides (D, B*D, 1)
    assert not q.is_contiguous()
    _, k, v = make_inputs(B, Hkv, G, D, S, dtype, gen)
    seqlens = torch.tensor([90, 33], dtype=torch.int32)
    check(q, k, v, seqlens, None, 0.3, 3, k, v, dtype)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_strided_cache_view():
    """Cache that is a view of a bigger buffer (e.g. fused KV / larger S_max): strides honoured."""
    gen = torch.Generator().manual_seed(4)
    dtype = torch.float16
    B, Hkv, G, D, S = 2, 2, 2, 64, 80
    kv = torch.randn(B, S, 2, Hkv, D, generator=gen, dtype=torch.float64).to(dtype)
    k, v = kv[:, :, 0], kv[:, :, 1]
    q = torch.randn(B, Hkv * G, D, generator=gen, dtype=torch.float64).to(dtype)
    seqlens = torch.tensor([80, 65], dtype=torch.int32)
    check(q, k, v, seqlens, None, D ** -0.5, 2, k, v, dtype)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_all_empty():
    gen = torch.Generator().manual_seed(5)
    q, k, v = make_inputs(2, 1, 3, 64, 8, torch.float32, gen)
    seqlens = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    o_part, lse_part = flash_decode_partials(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), seqlens, None, 0.125, 4)
    assert torch.all(o_part == 0)
    assert torch.all(lse_part == -math.inf)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_large_scores_no_overflow():
    """Big logits (scale 1, |q.k| ~ hundreds) must stay finite and accurate in fp32."""
    gen = torch.Generator().manual_seed(6)
    dtype = torch.float32
    q, k, v = make_inputs(1, 1, 3, 64, 150, dtype, gen)
    q = q * 8
    seqlens = torch.tensor([150], dtype=torch.int32)
    check(q, k, v, seqlens, None, 1.0, 3, k, v, dtype)


def test_choose_num_splits():
    # Big batch already fills the GPU.
    assert choose_num_splits(64, 8, 131072, 132) == 1
    # Single sequence, one KV head, long context: many splits, capped at 128.
    assert choose_num_splits(1, 1, 1 << 20, 132) == 128
    # One wave: 1*8 programs on 132 SMs -> the largest power of two <= 16.5.
    assert choose_num_splits(1, 8, 1 << 17, 132) == 16
    assert choose_num_splits(32, 2, 2048, 132) == 2  # the Flash-Decoding table's 32 x 2048
    # Short capacity limits splits to >= 256 keys each.
    assert choose_num_splits(1, 8, 1024, 132) == 4
    assert choose_num_splits(1, 8, 100, 132) == 1
    # Monotone non-increasing in batch.
    vals = [choose_num_splits(b, 8, 1 << 16, 132) for b in range(1, 40)]
    assert all(a >= c for a, c in zip(vals, vals[1:]))
    assert all(v >= 1 for v in vals)
    # An fp8 cache: four programs per SM, up to 256 splits, where splits keep >= 1024 keys.
    assert choose_num_splits(1, 8, 1 << 18, 132, **FP8_SPLITS) == 64
    assert choose_num_splits(1, 2, 1 << 18, 132, **FP8_SPLITS) == 256
    assert choose_num_splits(1, 1, 1 << 20, 132, **FP8_SPLITS) == 256
    assert choose_num_splits(8, 2, 8192, 132, **FP8_SPLITS) == 8  # 1024 keys, not 16 x 512
    assert choose_num_splits(64, 2, 1024, 132, **FP8_SPLITS) == 1


def test_launch_config_by_gpu(monkeypatch):
    """64-key blocks from 1024 keys per split on GPUs named H100, 128 on others (measured);
    64 below 1024 keys everywhere; an fp8 cache's rule by programs per SM. The device name and
    SM count are stubbed: no GPU needed."""
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200"}
    monkeypatch.setattr(kernel_utils, "_device_name", lambda index: names[index])
    monkeypatch.setattr(kernel_utils, "num_sms", lambda index: 132)
    h100, h200 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert _launch_config(128, torch.float16, 16, 1024, h100) == (64, 4, 3)
    assert _launch_config(128, torch.bfloat16, 16, 65536, h100) == (64, 4, 3)
    assert _launch_config(128, torch.float16, 16, 1024, h200) == (128, 4, 3)
    assert _launch_config(128, torch.float16, 16, 1024, torch.device("cpu")) == (128, 4, 3)
    for dev in (h100, h200):
        assert _launch_config(128, torch.float16, 16, 512, dev) == (64, 4, 3)
        assert _launch_config(128, torch.float16, 16, 256, dev) == (64, 4, 2)
        # An fp8 cache (tiles widened to float16): 64-key blocks, 2 warps, 2 stages (H100) or
        # 3 (H200) for more than two programs per SM; 128-key blocks, 4 warps, 2 stages for two.
        fp8_rule = functools.partial(_launch_config, 128, torch.float16, 16, device=dev, fp8=True)
        assert fp8_rule(2048, programs=512) == (64, 2, 2 if dev == h100 else 3)
        assert fp8_rule(2048, programs=256) == (128, 4, 2)
        assert fp8_rule(1024, programs=128) == (128, 4, 3)
        # Its V key-major: 128-key blocks, 4 warps, 3 stages at any program count.
        for programs in (512, 256, 128):
            assert fp8_rule(2048, programs=programs, key_major=True) == (128, 4, 3)


def test_split_head_tile_rule_by_gpu(monkeypatch):
    """A head in two tiles (96 = 64 + 32) on an H200: two programs per SM while splits keep
    >= 1024 keys, with 64-key blocks (an fp8 cache: four per SM, on any GPU); the H100,
    power-of-two heads and the padded tile keep the one-wave rule. Device names and SM counts
    are stubbed: no GPU."""
    import longctx.kernels.decode as kd
    from longctx.kernels.decode import splits_rule

    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200"}
    monkeypatch.setattr(kernel_utils, "_device_name", lambda index: names[index])
    monkeypatch.setattr(kernel_utils, "num_sms", lambda index: 132)
    h100, h200 = torch.device("cuda", 0), torch.device("cuda", 1)
    shapes = ((64, 1024), (8, 8192), (1, 65536), (1, 131072), (1, 262144))

    def splits(d, dev, fp8=False):
        return [choose_num_splits(b, 2, n, 132, **splits_rule(d, fp8, dev)) for b, n in shapes]

    assert splits(96, h200) == splits(80, h200) == [1, 8, 64, 128, 128]
    for d, dev in ((96, h100), (128, h200), (256, h200)):
        assert splits(d, dev) == [1, 8, 64, 64, 64], (d, dev)
    assert splits(128, h100, fp8=True) == splits(128, h200, fp8=True) == [1, 8, 64, 128, 256]
    monkeypatch.setattr(kd, "SPLIT_HEADS", False)  # padded to one tile of 128
    assert splits(96, h200) == [1, 8, 64, 64, 64]
    monkeypatch.setattr(kd, "SPLIT_HEADS", True)
    # 64-key blocks for two programs per SM from 1024 keys; one program per SM keeps 128.
    assert _launch_config(96, torch.float16, 16, 2048, h200, programs=256) == (64, 4, 3)
    assert _launch_config(96, torch.float16, 16, 4096, h200, programs=128) == (128, 4, 3)
    assert _launch_config(128, torch.float16, 16, 2048, h200, programs=256) == (128, 4, 3)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_large_group_head_blocks(dtype):
    """G=80 > _MAX_BLOCK_H: query heads are spread over 2 head-block programs (64 + 16 rows)."""
    gen = torch.Generator().manual_seed(7)
    B, Hkv, G, D, S = 1, 1, 80, 64, 50
    q, k, v = make_inputs(B, Hkv, G, D, S, dtype, gen)
    seqlens = torch.tensor([41], dtype=torch.int32)
    check(q, k, v, seqlens, None, D ** -0.5, 2, k, v, dtype)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_group6_d256_paged():
    """G=6 and head_dim 256 with a paged cache (BLOCK_N <= page_size path for fp32)."""
    gen = torch.Generator().manual_seed(8)
    dtype = torch.float32
    B, Hkv, G, D, S, ps = 2, 1, 6, 256, 60, 16
    q, k_log, v_log = make_inputs(B, Hkv, G, D, S, dtype, gen)
    k_pages, v_pages, bt = make_paged(k_log, v_log, ps, gen)
    seqlens = torch.tensor([60, 23], dtype=torch.int32)
    check(q, k_pages, v_pages, seqlens, bt, D ** -0.5, 3,
          gather_logical(k_pages, bt, S), gather_logical(v_pages, bt, S), dtype)


_NP_MAJOR_MINOR = tuple(int(x) for x in __import__("numpy").__version__.split(".")[:2])


@pytest.mark.interpreter
@pytest.mark.skipif(_NP_MAJOR_MINOR >= (2, 4),
                    reason="for-loop path under the interpreter needs numpy < 2.4")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
@pytest.mark.parametrize("paged", [False, True], ids=["contig", "paged"])
def test_gpu_for_loop_path(monkeypatch, paged):
    """Exercise the scf.for loop variant that GPU builds compile (interpreter normally uses while)."""
    import longctx.kernels.decode as decode

    monkeypatch.setattr(decode, "_INTERPRET", False)
    gen = torch.Generator().manual_seed(9)
    dtype = torch.float16
    B, Hkv, G, D, S = 3, 1, 3, 64, 150
    q, k_log, v_log = make_inputs(B, Hkv, G, D, S, dtype, gen)
    seqlens = torch.tensor([150, 0, 17], dtype=torch.int32)
    if paged:
        k_pages, v_pages, bt = make_paged(k_log, v_log, 16, gen)
        check(q, k_pages, v_pages, seqlens, bt, D ** -0.5, 3,
              gather_logical(k_pages, bt, S), gather_logical(v_pages, bt, S), dtype)
    else:
        check(q, k_log, v_log, seqlens, None, D ** -0.5, 3, k_log, v_log, dtype)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["contiguous", "paged", "fp8"])
def test_what_lies_past_the_end_is_never_used(layout):
    """Cache rows past each sequence's length (and their fp8 scales) hold NaN / inf: the output is
    bit for bit that of a cache holding zeros there. The last block of a split reads key
    end - 1 in their place (kernels/decode.py `_attend_block`), never the rows themselves."""
    from longctx.fp8 import FP8, quantize_kv

    B, S, Hkv, G, D = 3, 100, 2, 3, 64
    lens = torch.tensor([17, 70, 1], dtype=torch.int32)
    q, k, v = make_inputs(B, Hkv, G, D, S, torch.float16, torch.Generator().manual_seed(5))
    past = torch.arange(S)[None, :] >= lens[:, None]  # [B, S]
    outs = []
    for poison in (0.0, float("nan")):
        kc, vc = k.clone(), v.clone()
        kc[past], vc[past] = poison, -poison if poison == 0 else float("inf")
        kw = {}
        if layout == "fp8":
            (kc, ks), (vc, vs) = quantize_kv(k), quantize_kv(v)
            for x, sc in ((kc, ks), (vc, vs)):
                x.view(torch.uint8)[past] = 0 if poison == 0 else 0x7F  # e4m3's NaN
                sc[past] = poison
            kw = dict(k_scale=ks.to(DEVICE), v_scale=vs.to(DEVICE))
        table = None
        if layout == "paged":  # pages of 16 rows in reverse order
            n = -(-S // 16)
            pad = n * 16 - S
            kc, vc = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad), value=poison)
                      .view(B * n, 16, Hkv, D).flip(0).contiguous() for x in (kc, vc))
            table = (B * n - 1 - torch.arange(B * n, dtype=torch.int32)).view(B, n).to(DEVICE)
        assert kc.dtype in (torch.float16, FP8)
        for splits in (1, 3):
            o, lse = flash_decode(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), lens.to(DEVICE),
                                  table, D ** -0.5, splits, "separate", **kw)
            outs.append((splits, o.cpu(), lse.cpu()))
    for (sp, o0, l0), (_, o1, l1) in zip(outs[:2], outs[2:]):
        assert torch.isfinite(o1).all() and torch.isfinite(l1).all(), (layout, sp)
        assert torch.equal(o0, o1) and torch.equal(l0, l1), (layout, sp)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_invalid_lengths_and_pages_give_nan_not_garbage():
    # The CUDA path cannot raise without a host sync: the kernel flags the sequence with NaN.
    B, S, Hq, Hkv, D = 3, 64, 4, 2, 64
    q = torch.randn(B, Hq, D, device=DEVICE, dtype=torch.float16)
    k = torch.randn(B, S, Hkv, D, device=DEVICE, dtype=torch.float16)
    seqlens = torch.tensor([64, 65, -1], dtype=torch.int32, device=DEVICE)
    for splits, merge in ((1, "auto"), (3, "fused"), (3, "separate")):
        o, lse = flash_decode(q, k, k, seqlens, None, D**-0.5, splits, merge)
        assert torch.isfinite(o[0]).all() and torch.isnan(o[1:]).all() and torch.isnan(lse[1:]).all()
    pages = k.view(B * 4, 16, Hkv, D)
    table = torch.arange(B * 4, dtype=torch.int32, device=DEVICE).view(B, 4)
    table[1, 2] = B * 4  # out of range, within the length
    table[2, 3] = -5     # out of range, past the length: never read, harmless
    seqlens = torch.tensor([64, 64, 40], dtype=torch.int32, device=DEVICE)
    for merge in ("fused", "separate"):
        o, lse = flash_decode(q, pages, pages, seqlens, table, D**-0.5, 2, merge)
        assert torch.isnan(o[1]).all() and torch.isnan(lse[1]).all()
        assert torch.isfinite(o[[0, 2]]).all() and torch.isfinite(lse[[0, 2]]).all()
