"""Key-tile bounds and online-softmax steps of one query tile, as Triton functions.

The Gluon Hopper prefill kernel (kernels/prefill_hopper.py) calls these from Gluon (Triton
functions are callable there, as kernels/merge.py's are); tests/test_prefill_hopper.py runs the
same functions under the Triton interpreter on a CPU, so the masking rule of that kernel, which
has no interpreter, is checked on every machine.

The rule (the attention contract): query row i of a sequence (absolute position q_start + i)
sees key j (position k_start + j) iff j < seqlen_k and, when causal, j <= i + delta with
delta = q_start - k_start. A query tile of rows [m0, m0 + BLOCK_M) visits key tiles
[0, n_tiles): tiles [0, n_full) are visible to every real row of the tile (no mask), tiles
[n_full, n_tiles) are masked per row (the causal band, which may span several key tiles for any
delta, and the ragged end of the keys).
"""

from __future__ import annotations

import triton
import triton.language as tl

# |q_start - k_start| is clamped to this: sequences are shorter than 2**30, so the visibility
# pattern is the same and every bound below stays in int32.
DELTA_LIMIT = 1 << 30


@triton.jit
def _clamp_delta(q_start, k_start):
    """delta = q_start - k_start (int32 or int64 scalars) clamped to +-2**30, as int32."""
    d = q_start.to(tl.int64) - k_start.to(tl.int64)
    return tl.minimum(tl.maximum(d, -(1 << 30)), 1 << 30).to(tl.int32)


@triton.jit
def _key_tiles(m0, seqlen_q, seqlen_k, delta, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """(n_full, n_tiles) of the query tile starting at row m0: key tiles [0, n_full) are visible
    to every real row of the tile (rows < seqlen_q), tiles [n_full, n_tiles) need the mask,
    tiles from n_tiles on are invisible to every real row. n_tiles = 0 when the tile has no
    real row (varlen: a sequence shorter than the grid's) or its rows see no key."""
    rows_end = tl.minimum(m0 + BLOCK_M, seqlen_q)  # exclusive: the tile's real rows
    if CAUSAL:
        # the last real row sees keys j <= rows_end - 1 + delta, the first j <= m0 + delta
        hi = tl.minimum(tl.maximum(rows_end + delta, 0), seqlen_k)
        full = tl.minimum(tl.maximum(m0 + 1 + delta, 0), seqlen_k)
    else:
        hi = seqlen_k
        full = seqlen_k
    n_tiles = tl.where(m0 < seqlen_q, tl.cdiv(hi, BLOCK_N), 0)
    n_full = tl.minimum(full // BLOCK_N, n_tiles)
    return n_full, n_tiles


@triton.jit
def _row_key_limit(rows, seqlen_k, delta, CAUSAL: tl.constexpr):
    """Per query row (in-sequence index, int32 tensor): the number of leading keys it sees."""
    if CAUSAL:
        return tl.minimum(rows + delta + 1, seqlen_k)  # <= 0: sees nothing
    else:
        return rows * 0 + seqlen_k  # (no zeros_like: Gluon tensors carry a layout)


@triton.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    """Online softmax (base 2) of an unmasked score tile s [R, N] (fp32, raw Q K^T) against the
    running max m_i [R] (of scaled scores) and sum l_i [R]: (P, alpha, m, l). Every row sees
    every key of the tile, so m stays finite."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _softmax_step_masked(s, cols, limit, m_i, l_i, qk_scale):
    """_softmax_step with column c of the tile visible to row r iff cols[c] < limit[r] (cols: the
    tile's column indices [N], limit: per row the keys it sees minus the tile's first key).
    Rows that have seen no key yet keep m = -inf; they are shifted by 0 instead, so that
    exp2(-inf - (-inf)) = NaN never happens (their P and alpha are 0)."""
    s = tl.where(cols[None, :] < limit[:, None], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_sub[:, None])
    alpha = tl.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _row_lse(m_i, l_i):
    """Natural-log LSE of a finished row (m_i: base-2 max of scaled scores, l_i: sum of P);
    -inf for a row that saw no key (l_i = 0)."""
    return tl.where(l_i == 0.0, float("-inf"),
                    (m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))) * 0.6931471805599453)
