"""CPU emulation (numpy, float64) of fa_hopper._fa_fwd_hopper_kernel's tile schedule for the
brief order (SCHED 0/1): program -> (head, query tile) mapping for both grid orders, the K/V ring
(prologue loads, refills, slot and mbarrier-phase bookkeeping), the peeled first / last tiles,
the causal mask of the last tile and query tile 0's dummy tile. No GPU, no Triton: it checks
the index logic of the kernel, not the compiled code (check.py does that on a GPU).

Run:  python bench/experiments/gluon_fa_hopper/emulate_schedule.py
"""
import itertools

import numpy as np

BLOCK_M = 128


class Ring:
    """NUM_STAGES slots; one mbarrier per slot: its phase flips once per completed fill."""

    def __init__(self, ns):
        self.ns = ns
        self.fills = [[] for _ in range(ns)]  # key tile of every fill, in order

    def load(self, tile, key_tile, pred):
        if pred:
            self.fills[tile % self.ns].append(key_tile)

    def wait(self, slot, phase):
        # mbarrier.wait(bar, phase) returns once the phase with parity `phase` has completed;
        # the kernel waits for fill number k of a slot with parity k & 1. Here: the consumer
        # reads the most recent fill, which must have the expected parity.
        f = self.fills[slot]
        assert f, f"wait on empty slot {slot}"
        assert (len(f) - 1) & 1 == phase, f"slot {slot}: {len(f)} fills, waited for parity {phase}"
        return f[-1]


def softmax_step(s, m, l, scale, keep=None):
    if keep is None:
        m_new = np.maximum(m, s.max(1) * scale)
        p = np.exp2(s * scale - m_new[:, None])
        alpha = np.exp2(m - m_new)
    else:
        s = np.where(keep, s * scale, -np.inf)
        m_new = np.maximum(m, s.max(1))
        m_sub = np.where(m_new == -np.inf, 0.0, m_new)
        p = np.exp2(s - m_sub[:, None])
        alpha = np.exp2(m - m_sub)
    return p, alpha, m_new, l * alpha + p.sum(1)


def causal_keep(delta, bn):
    return np.arange(bn)[None, :] <= np.arange(BLOCK_M)[:, None] + delta


def map_pid(pid, S, nprog, causal, m_fastest):
    """program id -> (batch*head, query tile), as the kernel computes it."""
    num_m = S // BLOCK_M
    if m_fastest:
        bh, m_tile = pid // num_m, pid % num_m
    else:
        num_bh = nprog // num_m
        bh, m_tile = pid % num_bh, pid // num_bh
    if causal:
        m_tile = num_m - 1 - m_tile
    return bh, m_tile


def program(q, k, v, m_tile, S, BLOCK_N, NS, causal, scale):
    """One program; q [S, D] of its head, k/v [S, D] of its KV head. Returns (o, lse) of its tile."""
    m0 = m_tile * BLOCK_M
    single = S == BLOCK_N
    if single:
        n, kv_step = 1, BLOCK_N
    elif causal:
        n, kv_step = max((m0 + BLOCK_M) // BLOCK_N, 2), (0 if m0 == 0 else BLOCK_N)
    else:
        n, kv_step = S // BLOCK_N, BLOCK_N
    K, V = Ring(NS), Ring(NS)
    key = lambda t: k[t * BLOCK_N:(t + 1) * BLOCK_N]  # noqa: E731
    val = lambda t: v[t * BLOCK_N:(t + 1) * BLOCK_N]  # noqa: E731
    for t in range(NS):  # prologue: row0 + t * BLOCK_N with row0 = kv_row + t * (kv_step - BLOCK_N)
        kt = (t * (kv_step - BLOCK_N) + t * BLOCK_N) // BLOCK_N if causal else t
        K.load(t, kt, t < n)
        V.load(t, kt, t < n)
    qt = q[m0:m0 + BLOCK_M]
    m = np.full(BLOCK_M, -np.inf)
    l = np.zeros(BLOCK_M)
    s_cur = qt @ key(K.wait(0, 0)).T
    if single:
        keep = causal_keep(m0, BLOCK_N) if causal else None
        p, _, m, l = softmax_step(s_cur, m, l, scale, keep)
        acc = p @ val(V.wait(0, 0))
    else:
        # tile 0 (peeled)
        s_next = qt @ key(K.wait(1 % NS, (1 // NS) & 1)).T
        p, _, m, l = softmax_step(s_cur, m, l, scale)
        acc = p @ val(V.wait(0, 0))
        s_cur = s_next
        K.load(NS, NS, NS < n)
        K.load(NS + 1, NS + 1, NS + 1 < n)
        for j in range(1, n - 1):
            nxt = j + 1
            s_next = qt @ key(K.wait(nxt % NS, (nxt // NS) & 1)).T
            p, alpha, m, l = softmax_step(s_cur, m, l, scale)
            acc = acc * alpha[:, None] + p @ val(V.wait(j % NS, (j // NS) & 1))
            s_cur = s_next
            K.load(nxt + NS, nxt + NS, nxt + NS < n)
            V.load(j - 1 + NS, j - 1 + NS, j - 1 + NS < n)
        j = n - 1
        if causal:
            if m0 == 0:
                m = np.full(BLOCK_M, -np.inf)
            p, alpha, m, l = softmax_step(s_cur, m, l, scale, causal_keep(m0 - j * kv_step, BLOCK_N))
        else:
            p, alpha, m, l = softmax_step(s_cur, m, l, scale)
        acc = acc * alpha[:, None] + p @ val(V.wait(j % NS, (j // NS) & 1))
    empty = l == 0
    l_safe = np.where(empty, 1.0, l)
    lse = np.where(empty, -np.inf, (m + np.log2(l_safe)) * np.log(2.0))
    return acc / l_safe[:, None], lse


def reference(q, k, v, causal, scale):
    s = q @ k.T * scale
    if causal:
        s = np.where(np.tril(np.ones_like(s, dtype=bool)), s, -np.inf)
    lse = np.logaddexp.reduce(s, axis=1)
    return np.exp(s - lse[:, None]) @ v, lse


def main():
    rng = np.random.default_rng(0)
    D, H = 16, 2  # head_dim is irrelevant to the schedule; 2 heads to check the grid mapping
    worst = 0.0
    for S, BLOCK_N, NS, causal, m_fastest in itertools.product(
            (128, 256, 384, 512, 1024), (64, 128), (2, 3), (False, True), (True, False)):
        if causal and BLOCK_N != BLOCK_M:
            continue  # the kernel has no causal path for BLOCK_N=64 (static_assert)
        q = rng.standard_normal((H, S, D))
        k = rng.standard_normal((H, S, D)) * 3  # large scores: exercises the row max
        v = rng.standard_normal((H, S, D))
        scale = 1 / np.sqrt(D) * 1.4426950408889634
        o = np.full((H, S, D), np.nan)
        lse = np.full((H, S), np.nan)
        nprog = H * (S // BLOCK_M)
        seen = set()
        for pid in range(nprog):
            bh, mt = map_pid(pid, S, nprog, causal, m_fastest)
            oo, ll = program(q[bh], k[bh], v[bh], mt, S, BLOCK_N, NS, causal, scale)
            assert (bh, mt) not in seen
            seen.add((bh, mt))
            o[bh, mt * BLOCK_M:(mt + 1) * BLOCK_M] = oo
            lse[bh, mt * BLOCK_M:(mt + 1) * BLOCK_M] = ll
        assert len(seen) == nprog
        for h in range(H):
            o_ref, lse_ref = reference(q[h], k[h], v[h], causal, 1 / np.sqrt(D))
            err = max(np.abs(o[h] - o_ref).max(), np.abs(lse[h] - lse_ref).max())
            worst = max(worst, err)
            assert err < 1e-9, (S, BLOCK_N, NS, causal, m_fastest, h, err)
        print(f"S={S:5d} BLOCK_N={BLOCK_N:3d} NS={NS} causal={causal!s:5} m_fastest={m_fastest!s:5} ok")
    print(f"all schedules match the reference (max error {worst:.1e})")


if __name__ == "__main__":
    main()
