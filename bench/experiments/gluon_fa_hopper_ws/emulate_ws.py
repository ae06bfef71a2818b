"""CPU emulation of fa_ws.py's mbarrier protocol (no GPU, no triton): deadlocks and phase aliasing.

    python bench/experiments/gluon_fa_hopper_ws/emulate_ws.py

The producer and the two consumer warpgroups are generators that replay, op by op, the barrier
traffic of the kernel's partitions (mirrored by hand from fa_ws.py: keep in sync):
  wait(bar, parity, k)  try_wait.parity loop; k = the phase the code means to wait for
                        (-1: the phase before phase 0, which a fresh mbarrier counts as done)
  arrive(bar)           one arrive (a warpgroup's elected thread after its partition bar.sync)
  load(bar, slot, tile) arrive.expect_tx + TMA: the tx bytes land later, at a random time
  use(slot, tile)       a wgmma issue or retire reading a ring slot: the slot must hold that tile
A random scheduler interleaves them (and the TMA completions). Checked:
  * no deadlock (every agent finishes);
  * a wait passes only when exactly phases 0..k of its barrier have completed (the hardware
    parity test would also pass two phases early or late: that would be a protocol bug);
  * every GEMM reads the tile it expects (no slot refilled while still in use).
Protocols: "fa3" = SCHED 0/1/3/5 (_mainloop_fa3 / _mainloop_fa3u), "brief" = SCHED 2,
"x" = SCHED 4. The unrolled variants issue the same barrier sequence as their plain form.
"""
import itertools
import random


class Bar:
    def __init__(self, name, count):
        self.name, self.count = name, count
        self.pending, self.tx, self.done = count, 0, 0  # done = completed phases

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.done += 1
            self.pending = self.count

    def arrive(self, tx=0):
        assert self.pending > 0, f"{self.name}: arrive on a full phase"
        self.tx += tx
        self.pending -= 1
        self._maybe_complete()

    def land(self, tx):
        self.tx -= tx
        assert self.tx >= 0
        self._maybe_complete()

    def passes(self, parity):
        return (self.done & 1) != parity  # try_wait.parity: the phase of that parity completed


def sched_wait(sched, r, wg, pingpong):
    if pingpong:
        yield ("wait", sched[wg], (r & 1) ^ (1 - wg), r - 1 if wg == 0 else r)


def sched_arrive(sched, wg, pingpong):
    if pingpong:
        yield ("arrive", sched[1 - wg])


def producer(n, ns, B):
    for wg in range(2):
        yield ("load", B["q"][wg], ("q", wg), wg)

    def load(kind, t):
        slot = t % ns
        yield ("wait", B[kind + "_empty"][slot], ((t // ns) & 1) ^ 1, t // ns - 1)
        yield ("load", B[kind + "_full"][slot], (kind, slot), t)

    yield from load("k", 0)
    for t in range(n - 1):
        yield from load("k", t + 1)
        yield from load("v", t)
    yield from load("v", n - 1)


def consumer_fa3(n, ns, B, wg, pp):
    S = B["sched"]
    yield ("wait", B["q"][wg], 0, 0)
    yield ("wait", B["k_full"][0], 0, 0)
    yield from sched_wait(S, 0, wg, pp)
    yield ("use", ("k", 0), 0)
    yield from sched_arrive(S, wg, pp)
    yield ("use", ("k", 0), 0)
    yield ("arrive", B["k_empty"][0])
    for j in range(n - 1):
        t = j + 1
        ks = t % ns
        yield ("wait", B["k_full"][ks], (t // ns) & 1, t // ns)
        yield from sched_wait(S, t, wg, pp)
        yield ("use", ("k", ks), t)
        vs = j % ns
        yield ("wait", B["v_full"][vs], (j // ns) & 1, j // ns)
        yield ("use", ("v", vs), j)
        yield from sched_arrive(S, wg, pp)
        yield ("use", ("k", ks), t)
        yield ("arrive", B["k_empty"][ks])
        yield ("use", ("v", vs), j)
        yield ("arrive", B["v_empty"][vs])
    j = n - 1
    vs = j % ns
    yield ("wait", B["v_full"][vs], (j // ns) & 1, j // ns)
    yield from sched_wait(S, n, wg, pp)
    yield ("use", ("v", vs), j)
    yield from sched_arrive(S, wg, pp)
    yield ("use", ("v", vs), j)
    yield ("arrive", B["v_empty"][vs])


def consumer_brief(n, ns, B, wg, pp):
    S = B["sched"]
    yield ("wait", B["q"][wg], 0, 0)
    yield ("wait", B["k_full"][0], 0, 0)
    yield from sched_wait(S, 0, wg, pp)
    yield ("use", ("k", 0), 0)
    yield from sched_arrive(S, wg, pp)
    yield ("use", ("k", 0), 0)
    yield ("arrive", B["k_empty"][0])
    yield from sched_wait(S, 1, wg, pp)
    for j in range(n - 1):
        t = j + 1
        ks = t % ns
        yield ("wait", B["k_full"][ks], (t // ns) & 1, t // ns)
        yield ("use", ("k", ks), t)
        yield from sched_arrive(S, wg, pp)
        yield ("use", ("k", ks), t)           # wait(0) retires S_{j+1} and P_{j-1} V_{j-1}
        if j > 0:
            yield ("use", ("v", (j - 1) % ns), j - 1)
        yield ("arrive", B["k_empty"][ks])
        if j > 0:
            yield ("arrive", B["v_empty"][(j + ns - 1) % ns])
        vs = j % ns
        yield ("wait", B["v_full"][vs], (j // ns) & 1, j // ns)
        yield from sched_wait(S, j + 2, wg, pp)
        yield ("use", ("v", vs), j)
    yield from sched_arrive(S, wg, pp)
    if n > 1:
        yield ("use", ("v", (n - 2) % ns), n - 2)
        yield ("arrive", B["v_empty"][(n + ns - 2) % ns])
    j = n - 1
    vs = j % ns
    yield ("wait", B["v_full"][vs], (j // ns) & 1, j // ns)
    yield from sched_wait(S, n + 1, wg, pp)
    yield ("use", ("v", vs), j)
    yield from sched_arrive(S, wg, pp)
    yield ("use", ("v", vs), j)
    yield ("arrive", B["v_empty"][vs])


def consumer_x(n, ns, B, wg, pp):
    S = B["sched"]
    yield ("wait", B["q"][wg], 0, 0)
    yield ("wait", B["k_full"][0], 0, 0)
    yield from sched_wait(S, 0, wg, pp)
    yield ("use", ("k", 0), 0)
    yield from sched_arrive(S, wg, pp)
    yield ("use", ("k", 0), 0)
    yield ("arrive", B["k_empty"][0])
    for j in range(n - 1):
        t = j + 1
        ks = t % ns
        yield ("wait", B["k_full"][ks], (t // ns) & 1, t // ns)
        yield from sched_wait(S, t, wg, pp)
        yield ("use", ("k", ks), t)
        if j > 0:
            yield ("use", ("v", (j - 1) % ns), j - 1)
            yield ("arrive", B["v_empty"][(j + ns - 1) % ns])
        vs = j % ns
        yield ("wait", B["v_full"][vs], (j // ns) & 1, j // ns)
        yield ("use", ("v", vs), j)
        yield from sched_arrive(S, wg, pp)
        yield ("use", ("k", ks), t)
        yield ("arrive", B["k_empty"][ks])
    if n > 1:
        yield ("use", ("v", (n - 2) % ns), n - 2)
        yield ("arrive", B["v_empty"][(n + ns - 2) % ns])
    j = n - 1
    vs = j % ns
    yield ("wait", B["v_full"][vs], (j // ns) & 1, j // ns)
    yield from sched_wait(S, n, wg, pp)
    yield ("use", ("v", vs), j)
    yield from sched_arrive(S, wg, pp)
    yield ("use", ("v", vs), j)
    yield ("arrive", B["v_empty"][vs])


CONSUMERS = {"fa3": consumer_fa3, "brief": consumer_brief, "x": consumer_x}


def run(proto, n, ns, pp, seed):
    rng = random.Random(seed)
    B = {"q": [Bar(f"q{i}", 1) for i in range(2)], "sched": [Bar(f"sched{i}", 1) for i in range(2)]}
    for kind in ("k", "v"):
        B[kind + "_full"] = [Bar(f"{kind}_full{i}", 1) for i in range(ns)]
        B[kind + "_empty"] = [Bar(f"{kind}_empty{i}", 2) for i in range(ns)]
    slots = {}
    agents = {"P": producer(n, ns, B), "C0": CONSUMERS[proto](n, ns, B, 0, pp),
              "C1": CONSUMERS[proto](n, ns, B, 1, pp)}
    cur = {a: next(g) for a, g in agents.items()}
    inflight = []  # (bar, slot key, tile)
    while cur or inflight:
        ready = []
        for a, op in cur.items():
            if op[0] != "wait" or op[1].passes(op[2]):
                ready.append(a)
        choices = ready + (["TMA"] if inflight else [])
        if not choices:
            return f"DEADLOCK: {{{', '.join(f'{a}: wait {op[1].name} parity {op[2]} (done={op[1].done})' for a, op in cur.items())}}}"
        a = rng.choice(choices)
        if a == "TMA":
            bar, key, tile = inflight.pop(rng.randrange(len(inflight)))
            slots[key] = tile
            bar.land(1)
            continue
        op = cur[a]
        if op[0] == "wait":
            bar, parity, k = op[1:]
            if bar.done != k + 1:
                return f"PHASE ALIASING: {a} waited {bar.name} for phase {k}, passed with {bar.done} completed"
        elif op[0] == "arrive":
            op[1].arrive()
        elif op[0] == "load":
            bar, key, tile = op[1:]
            bar.arrive(tx=1)
            inflight.append((bar, key, tile))
        elif op[0] == "use":
            key, tile = op[1:]
            if slots.get(key) != tile:
                return f"DATA RACE: {a} read {key} expecting tile {tile}, slot holds {slots.get(key)}"
        try:
            cur[a] = next(agents[a])
        except StopIteration:
            del cur[a]
    return None


def main():
    bad = 0
    runs = 0
    for proto, n, ns, pp in itertools.product(CONSUMERS, range(1, 8), (2, 3), (True, False)):
        for seed in range(300):
            runs += 1
            err = run(proto, n, ns, pp, seed)
            if err:
                bad += 1
                print(f"{proto} n_tiles={n} NS={ns} pingpong={pp} seed={seed}: {err}")
                break
    print(f"{runs} randomized runs, {bad} failing configurations")


if __name__ == "__main__":
    main()
