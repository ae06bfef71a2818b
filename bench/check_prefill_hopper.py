"""GPU check of the library's Hopper prefill path (kernels/prefill_hopper.py); needs an sm_90 GPU.

    python bench/check_prefill_hopper.py [--quick] [--skip-correctness] [--skip-timing]

The first thing to run after a change of the Gluon kernel. The parent process only orchestrates.
Each GPU section runs in a child process (this script with --child ...) under a watchdog: a child
that prints nothing for IDLE_S seconds (a hung kernel, e.g. an mbarrier deadlock) or runs past
TOTAL_S is killed and reported; the timing section then re-runs its remaining cases without the
variant that hung. Every launch prints a line first, so the watchdog sees progress and names the
culprit.

(a) correctness: longctx.attention / attention_merge_into as dispatched (a counter confirms that
    the Gluon kernel ran: HopperLaunch) and direct hopper_attention_fwd calls (shapes the dispatch keeps on
    the Triton kernel: 1, 127, 129, 1000 rows), against the project's reference in fp32 on the
    GPU, per sequence: lengths that are no multiples of 128, B > 1 (device-side descriptors),
    the device-side descriptors forced at B = 1, causal offsets (chunked prefill, rows before
    their keys, [B] tensors), varlen with a 0- and a 1-row sequence, head_dim 64 / 256, the
    fused merge with ragged rows (a state with empty -inf / NaN rows, rows past Sq left alone).
    'ok' = finite, empty rows exactly O = 0 / LSE = -inf, and at most 2x the error of the same
    call with LONGCTX_PREFILL_KERNEL=triton (+1e-5).
(b) timing, bf16, B = 1 unless said: cuDNN (SDPA), longctx as dispatched ("longctx"), with
    LONGCTX_PREFILL_KERNEL=triton ("triton") and, for dense B = 1, the Gluon kernel on
    device-side descriptors ("gluon-dev": what B > 1 / varlen pay for them), interleaved,
    ROUNDS rounds, median of the rounds (triton.testing.do_bench medians, L2 flushed): odd
    lengths at D = 128 (24/8 12000 causal first), 16384 (a multiple of 128, against
    earlier runs), head_dim 64 / 256 at 16384, and a varlen batch (8 sequences, 65536 tokens;
    "dense8" = longctx on 8 x 8192 dense rows, the same tokens; cuDNN: one call per sequence).
    TFLOPS = 4 * Hq * S^2 * D per sequence / t, halved for causal.
The summary table comes last. Runtime on an H100: about 4 minutes (half of it compiling).
"""
import os
import select
import statistics
import subprocess
import sys
import time

IDLE_S = 90          # watchdog: a child silent this long is considered hung (compiles included)
TOTAL_S = 420        # hard cap per child
ROUNDS = 3
REP_MS = 40
VARLEN = dict(total=65536, num_seqs=8, seed=0)   # launch/bench.py's any_length varlen rows


def say(*a):
    print(*a, flush=True)


def short(e):
    msg = str(e).strip().splitlines()
    return f"FAILED {type(e).__name__}: {msg[-1] if msg else ''}"[:300]


# =============================================================================================
# child side (GPU)
# =============================================================================================
def child_imports():
    global torch, triton, longctx, PH, reference_attention, merge_states_torch, varlen_lengths
    import torch
    import triton

    import longctx
    import longctx.kernels.prefill_hopper as PH
    from longctx.merge import merge_states_torch
    from longctx.reference import reference_attention

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "launch"))
    from bench import varlen_lengths


class GluonCounter:
    """Counts the Gluon kernel's launches by the dispatch (HopperLaunch's two launch methods,
    wrapped on the class: the fast path and Triton's)."""

    def __init__(self):
        self.n = 0
        for name in ("__call__", "generic"):
            real = getattr(PH.HopperLaunch, name)

            def counted(*a, _real=real, **kw):
                self.n += 1
                return _real(*a, **kw)
            setattr(PH.HopperLaunch, name, counted)


def set_kernel(choice):
    """Every later call runs `choice` ("auto" or "triton"), as `prefill_kernel(choice)` does in
    its block."""
    import longctx.kernels.prefill as P

    P._prefill_choice = P._parse_prefill_kernel(choice)


def rand(shape, dtype, g):
    return torch.randn(*shape, device="cuda", dtype=torch.float32, generator=g).to(dtype)


def cu_seqlens(lens):
    return torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32,
                        device="cuda")


def verdict(name, errs, ref_errs, finite, counted):
    ok = finite and all(e <= 2 * r + 1e-5 for e, r in zip(errs, ref_errs)) and counted
    say(f"   {name:<66} o {errs[0]:.2e} lse {errs[1]:.2e} | triton o {ref_errs[0]:.2e} "
        f"lse {ref_errs[1]:.2e} | gluon ran: {counted} finite: {finite}  {'ok' if ok else 'BAD'}")
    return ok


def case(name, via, b, sq, sk, heads, causal, d=128, dtype="bf16", q_start=0, k_start=0):
    """One correctness case: (name, via, B, Sq, Sk, Hq, Hkv, D, dtype, causal, q_start, k_start).
    via: "api" (longctx.attention; the counter must see the Gluon kernel), "direct"
    (hopper_attention_fwd), "device" (direct, device-side descriptors forced), "varlen-api" /
    "varlen-direct" (b: the sequences' query lengths; sk: their key lengths, or 0 for the same;
    sq unused). heads: (Hq, Hkv). Offsets: ints or per-sequence lists."""
    return (name, via, b, sq, sk, *heads, d, dtype, causal, q_start, k_start)


def correctness_cases():
    lens = varlen_lengths(24576, 8, 1)
    lens[0], lens[1] = 0, 1
    lens[2] += 24576 - sum(lens)
    return [
        case("12000 causal 6/2", "api", 1, 12000, 12000, (6, 2), True),
        case("4000 full 16/2", "api", 1, 4000, 4000, (16, 2), False),
        case("65537 x 2000 keys full 4/1", "api", 1, 65537, 2000, (4, 1), False),
        case("B=2 2500 causal q_start 100 k_start 400 (device desc)", "api", 2, 2500, 2500, (8, 2),
             True, q_start=100, k_start=400),
        case("B=2 3000 full fp16 (device desc)", "api", 2, 3000, 3000, (12, 4), False,
             dtype="fp16"),
        case("chunked prefill 2100 x 9000 q_start 6900", "api", 1, 2100, 9000, (16, 2), True,
             q_start=6900),
        case("B=2 tensor offsets 3000 x 5000", "api", 2, 3000, 5000, (8, 1), True,
             q_start=[2000, 0], k_start=[0, 700]),
        case("1 row causal", "direct", 1, 1, 1, (6, 2), True),
        case("127 full", "direct", 1, 127, 127, (3, 1), False),
        case("129 causal gqa 8 fp16", "direct", 1, 129, 129, (8, 1), True, dtype="fp16"),
        case("1000 causal rows before keys (500 empty)", "direct", 1, 1000, 1000, (6, 2), True,
             k_start=500),
        case("300 x 200 every row empty", "direct", 1, 300, 200, (6, 2), True, k_start=1000),
        case("B=2 1000 x 3000 causal q_start 2000", "direct", 2, 1000, 3000, (6, 2), True,
             q_start=2000),
        case("B=1 1000 device desc forced", "device", 1, 1000, 1000, (6, 2), True),
        case("B=1 129 x 3000 device desc forced", "device", 1, 129, 3000, (6, 2), False),
        case("varlen 8 seqs 24576 causal (0, 1 rows)", "varlen-api", lens, 0, 0, (16, 2), True),
        case("varlen 8 seqs 24576 full", "varlen-api", lens, 0, 0, (16, 2), False),
        case("varlen small causal offsets (no rows, no keys)", "varlen-direct", [1, 500, 0, 700, 3],
             0, [50, 2000, 10, 700, 0], (6, 2), True, q_start=[49, 1500, 0, 0, 0],
             k_start=[0, 0, 0, 100, 0]),
        case("D=64 4000 causal", "api", 1, 4000, 4000, (16, 2), True, d=64),
        case("D=64 B=2 1000 full", "direct", 2, 1000, 1000, (6, 2), False, d=64),
        case("D=256 4000 causal", "api", 1, 4000, 4000, (16, 2), True, d=256),
        case("D=256 B=2 1000 x 777 causal q_start 600 fp16", "direct", 2, 1000, 777, (6, 2), True,
             d=256, dtype="fp16", q_start=600),
        case("D=256 varlen full", "varlen-direct", [1, 257, 0, 1000], 0, [1, 257, 5, 1000], (8, 1),
             False, d=256),
    ]


def reference(q, k, v, scale, causal, qs, ks):
    """fp32 reference of one sequence q [Sq, Hq, D], k/v [Sk, Hkv, D] in blocks of query rows:
    o [Sq, Hq, D], lse [Sq, Hq]."""
    sq, hq, _ = q.shape
    block = max(64, (1 << 28) // max(1, k.shape[0] * hq))
    os_, ls = [], []
    for a in range(0, sq, block):
        o, lse = reference_attention(q[a:a + block][None].float(), k[None].float(),
                                     v[None].float(), causal=causal, softmax_scale=scale,
                                     q_start=qs + a, k_start=ks)
        os_.append(o[0])
        ls.append(lse[0])
    return torch.cat(os_), torch.cat(ls)


def seq_errors(o, lse, q, k, v, scale, causal, qs, ks):
    """(o error, lse error, empty rows right) of one sequence against the fp32 reference."""
    if q.shape[0] == 0:
        return 0.0, 0.0, True
    o_ref, lse_ref = reference(q, k, v, scale, causal, qs, ks)
    empty = torch.isneginf(lse_ref)
    rows_ok = bool(torch.equal(torch.isneginf(lse), empty)
                   and (o.float()[empty] == 0).all())
    valid = ~empty
    o_err = (o.float() - o_ref)[valid].abs().max().item() if valid.any() else 0.0
    l_err = (lse - lse_ref)[valid].abs().max().item() if valid.any() else 0.0
    return o_err, l_err, rows_ok


def run_case(case, g, counter):
    name, via, bl, sq, sk, hq, hkv, d, dts, causal, qs, ks = case
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dts]
    scale = d ** -0.5
    varlen = via.startswith("varlen")
    if varlen:
        lq = bl
        lk = sk if isinstance(sk, list) else bl
        batch = len(lq)
        q = rand((sum(lq), hq, d), dt, g)
        k, v = rand((sum(lk), hkv, d), dt, g), rand((sum(lk), hkv, d), dt, g)
        cq, ck = cu_seqlens(lq), cu_seqlens(lk)
        extra = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(lq))
        seqs = [(slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1])))
                for i in range(batch)]
    else:
        batch = bl
        q = rand((batch, sq, hq, d), dt, g)
        k, v = rand((batch, sk, hkv, d), dt, g), rand((batch, sk, hkv, d), dt, g)
        extra = {}
    def off(x, dtype):
        return torch.tensor(x, dtype=dtype, device="cuda") if isinstance(x, list) else x

    kw = dict(causal=causal, softmax_scale=scale, q_start=off(qs, torch.int32),
              k_start=off(ks, torch.int64))
    say(f"   launch {name}")
    n0 = counter.n
    set_kernel("auto")
    if via in ("api", "varlen-api"):
        api_kw = dict(kw, **extra)
        if varlen:
            api_kw["max_seqlen_k"] = max(lk)
        o, lse = longctx.attention(q, k, v, return_lse=True, **api_kw)
        counted = counter.n == n0 + 1
    else:
        o, lse = PH.hopper_attention_fwd(q, k, v, **kw, **extra,
                                         mode="device" if via == "device" else None)
        counted = True
    torch.cuda.synchronize()
    set_kernel("triton")
    t_kw = dict(kw, **extra)
    if varlen:
        t_kw["max_seqlen_k"] = max(lk)
    o_t, lse_t = longctx.attention(q, k, v, return_lse=True, **t_kw)
    set_kernel("auto")
    errs, t_errs, rows_ok = [0.0, 0.0], [0.0, 0.0], True
    for i in range(batch):
        qi = lambda x: x[i] if isinstance(x, list) else x  # noqa: E731
        if varlen:
            a, b = seqs[i]
            parts = (q[a], k[b], v[b])
            got, tri = (o[a], lse[a]), (o_t[a], lse_t[a])
        else:
            parts = (q[i], k[i], v[i])
            got, tri = (o[i], lse[i]), (o_t[i], lse_t[i])
        e = seq_errors(*got, *parts, scale, causal, qi(qs), qi(ks))
        et = seq_errors(*tri, *parts, scale, causal, qi(qs), qi(ks))
        errs = [max(errs[0], e[0]), max(errs[1], e[1])]
        t_errs = [max(t_errs[0], et[0]), max(t_errs[1], et[1])]
        rows_ok &= e[2]
    finite = bool(torch.isfinite(o.float()).all() and not torch.isnan(lse).any()) and rows_ok
    return verdict(name, errs, t_errs, finite, counted)


def accumulate_case(name, b, sq, blocks, hq, hkv, dts, via, g, counter):
    """A ring rank's steps merged into a state with empty (-inf / NaN) rows that is a slice of a
    longer buffer (rows past Sq must stay untouched), against the fp32 reference merged in
    torch; blocks: (Sk, causal, q_start, k_start)."""
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dts]
    q = rand((b, sq, hq, 128), dt, g)
    kv = [(rand((b, n, hkv, 128), dt, g), rand((b, n, hkv, 128), dt, g), c, qs, ks)
          for n, c, qs, ks in blocks]
    o0 = torch.randn(b, sq + 3, hq, 128, device="cuda", generator=g)
    l0 = torch.randn(b, sq + 3, hq, device="cuda", generator=g) * 3
    o0[:, 1::2], l0[:, 1::2] = float("nan"), float("-inf")
    ref = (o0[:, :sq].nan_to_num(0.0), l0[:, :sq].clone())
    for k, v, c, qs, ks in kv:
        parts = [reference(q[i], k[i], v[i], 128 ** -0.5, c, qs, ks) for i in range(b)]
        o_p = torch.stack([p[0] for p in parts])
        lse_p = torch.stack([p[1] for p in parts])
        ref = merge_states_torch(torch.stack([ref[0], o_p]),
                                 torch.stack([ref[1], lse_p.transpose(1, 2)]))
    states = {}
    for choice in ("auto", "triton"):
        set_kernel(choice)
        st = (o0.clone(), l0.clone())
        n0 = counter.n
        say(f"   launch {name} [{choice}]")
        for k, v, c, qs, ks in kv:
            acc = tuple(x[:, :sq] for x in st)
            if via == "direct" and choice == "auto":  # (counted: the module attribute is wrapped)
                PH.hopper_attention_fwd(q, k, v, softmax_scale=128 ** -0.5, causal=c,
                                        q_start=qs, k_start=ks, accumulate=acc)
            else:
                longctx.attention_merge_into(*acc, q, k, v, causal=c, q_start=qs, k_start=ks)
        torch.cuda.synchronize()
        states[choice] = (st, counter.n - n0)
    set_kernel("auto")
    (st_g, n_g), (st_t, _) = states["auto"], states["triton"]
    untouched = bool(torch.equal(st_g[1][:, sq:], l0[:, sq:])
                     and torch.equal(st_g[0][:, sq:].nan_to_num(7.0), o0[:, sq:].nan_to_num(7.0)))
    def err(st):
        return ((st[0][:, :sq] - ref[0]).abs().max().item(),
                (st[1][:, :sq] - ref[1]).abs().max().item())

    finite = bool(torch.isfinite(st_g[0][:, :sq]).all() and torch.isfinite(st_g[1][:, :sq]).all())
    return verdict(name + ("" if untouched else " ROWS PAST SQ CHANGED"), err(st_g), err(st_t),
                   finite and untouched, n_g == len(blocks))


def child_correctness():
    counter = GluonCounter()
    g = torch.Generator(device="cuda").manual_seed(0)
    n_bad = 0
    for case in correctness_cases():
        try:
            n_bad += not run_case(case, g, counter)
        except Exception as e:  # noqa: BLE001
            n_bad += 1
            say(f"   {case[0]}: {short(e)}")
        torch.cuda.empty_cache()
    acc_cases = [
        ("accumulate B=1 4225: 2048 full + 4225 causal + 4225 at q_start 300", 1, 4225,
         [(2048, False, 0, 0), (4225, True, 0, 0), (4225, True, 300, 0)], 16, 2, "bf16", "api"),
        ("accumulate B=2 1000 (device desc): 777 full + 1000 causal + 1 key", 2, 1000,
         [(777, False, 0, 0), (1000, True, 0, 0), (1, True, 5, 0)], 6, 2, "fp16", "direct"),
    ]
    for name, *rest in acc_cases:
        try:
            n_bad += not accumulate_case(name, *rest, g, counter)
        except Exception as e:  # noqa: BLE001
            n_bad += 1
            say(f"   {name}: {short(e)}")
    say(f"RESULT correctness {'ok' if n_bad == 0 else 'BAD'} ({n_bad} bad)")


def sdpa_cudnn(q, k, v, causal):
    """SDPA over cuDNN on [B, S, H, D] tensors (a list of them: one call each)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qkv = [tuple(x.transpose(1, 2) for x in t)
           for t in (q if isinstance(q, list) else [(q, k, v)])]

    def fn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return [torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=causal, enable_gqa=qt.shape[1] != kt.shape[1])
                for qt, kt, vt in qkv]
    return fn


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=REP_MS, return_mode="median")


# (label, kind, Hq, Hkv, N, D, causal); kind: dense (B = 1) or varlen (VARLEN's batch)
def timing_cases(quick):
    cases = [("24/8 12000 causal", "dense", 24, 8, 12000, 128, True),
             ("16/2 4000 causal", "dense", 16, 2, 4000, 128, True),
             ("16/2 4000 full", "dense", 16, 2, 4000, 128, False),
             ("32/32 33000 full", "dense", 32, 32, 33000, 128, False),
             ("16/2 65537 causal", "dense", 16, 2, 65537, 128, True),
             ("16/2 16384 causal", "dense", 16, 2, 16384, 128, True),
             ("16/2 16384 full", "dense", 16, 2, 16384, 128, False),
             ("varlen 16/2 causal", "varlen", 16, 2, VARLEN["total"], 128, True),
             ("varlen 24/8 full", "varlen", 24, 8, VARLEN["total"], 128, False),
             ("D=64 16/2 16384 causal", "dense", 16, 2, 16384, 64, True),
             ("D=64 32/32 16384 full", "dense", 32, 32, 16384, 64, False),
             ("D=256 16/2 16384 causal", "dense", 16, 2, 16384, 256, True),
             ("D=256 32/32 16384 full", "dense", 32, 32, 16384, 256, False)]
    return cases[:1] + cases[7:8] if quick else cases


def child_timing(todo, skip):
    say(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"triton {triton.__version__}")
    g = torch.Generator(device="cuda").manual_seed(1)
    bf16 = torch.bfloat16
    for label, kind, hq, hkv, n, d, causal in todo:
        lens = (varlen_lengths(VARLEN["total"], VARLEN["num_seqs"], VARLEN["seed"])
                if kind == "varlen" else [n])
        flops = sum(4.0 * hq * s * s * d * (0.5 if causal else 1.0) for s in lens)
        variants = []  # (name, fn, LONGCTX_PREFILL_KERNEL choice, FLOPs)
        if kind == "varlen":
            q = rand((n, hq, d), bf16, g)
            k, v = rand((n, hkv, d), bf16, g), rand((n, hkv, d), bf16, g)
            cu = cu_seqlens(lens)
            seqs = [tuple(x[a:e][None] for x in (q, k, v))
                    for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
            nd = n // len(lens)
            qd = rand((len(lens), nd, hq, d), bf16, g)
            kd, vd = rand((len(lens), nd, hkv, d), bf16, g), rand((len(lens), nd, hkv, d), bf16, g)

            def ours():
                return longctx.attention(q, k, v, causal=causal, cu_seqlens_q=cu,
                                         cu_seqlens_k=cu, max_seqlen_q=max(lens),
                                         max_seqlen_k=max(lens))
            variants += [("cudnn", sdpa_cudnn(seqs, None, None, causal), "auto", flops),
                         ("longctx", ours, "auto", flops), ("triton", ours, "triton", flops),
                         ("dense8", lambda: longctx.attention(qd, kd, vd, causal=causal),
                          "auto", len(lens) * 4.0 * hq * nd * nd * d * (0.5 if causal else 1))]
        else:
            q = rand((1, n, hq, d), bf16, g)
            k, v = rand((1, n, hkv, d), bf16, g), rand((1, n, hkv, d), bf16, g)

            def ours():
                return longctx.attention(q, k, v, causal=causal)

            def gluon_dev():
                return PH.hopper_attention_fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal,
                                               mode="device")
            variants += [("cudnn", sdpa_cudnn(q, k, v, causal), "auto", flops),
                         ("longctx", ours, "auto", flops), ("triton", ours, "triton", flops),
                         ("gluon-dev", gluon_dev, "auto", flops)]
        variants = [v_ for v_ in variants if v_[0] not in skip]
        say(f"-- CASE {label}")
        times = {name: [] for name, *_ in variants}
        for _ in range(ROUNDS):
            for name, fn, choice, _ in variants:
                try:
                    say(f"BEGIN {name}")
                    set_kernel(choice)
                    times[name].append(bench(fn))
                    say(f"END {name}")
                except Exception as e:  # noqa: BLE001
                    say(f"END {name}")
                    say(f"   {name}: {short(e)}")
        set_kernel("auto")
        for name, _, _, fl in variants:
            if times[name]:
                med = statistics.median(times[name])
                say(f"   {name:<10} {med:9.3f} ms {fl / med / 1e9:7.1f} TF  rounds "
                    f"[{', '.join(f'{t:.3f}' for t in times[name])}]")
                say(f"ROW|{label}|{name}|{fl / med / 1e9:.1f}")
        say(f"CASE DONE {label}")
        del q, k, v
        torch.cuda.empty_cache()


def child_main(argv):
    child_imports()
    assert torch.cuda.get_device_capability() == (9, 0), "needs an sm_90 GPU"
    if argv[0] == "correctness":
        child_correctness()
    else:
        quick, skip = argv[1] == "1", [s for s in argv[2].split(",") if s]
        done = set(argv[3].split(";")) if len(argv) > 3 else set()
        child_timing([c for c in timing_cases(quick) if c[0] not in done], skip)
    say("CHILD DONE")


# =============================================================================================
# parent side: watchdog
# =============================================================================================
def run_child(args):
    """Run a child, echo its output; returns (lines, hung_in): hung_in = the variant of the last
    unmatched 'BEGIN x' (or '?') when the watchdog killed the child or it crashed, else None."""
    cmd = [sys.executable, "-u", os.path.abspath(__file__), "--child", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    fd = p.stdout.fileno()
    lines, last, t0, current, buf, eof = [], time.time(), time.time(), None, b"", False
    while not eof:
        r, _, _ = select.select([fd], [], [], 5.0)
        if r:
            chunk = os.read(fd, 65536)
            if not chunk:
                eof = True
                chunk = b"\n" if buf else b""
            last = time.time()
            buf += chunk
            *complete, buf = buf.split(b"\n")
            for raw in complete:
                line = raw.decode(errors="replace")
                lines.append(line)
                if line.startswith("BEGIN "):
                    current = line.split(" ", 1)[1]
                elif line.startswith("END "):
                    current = None
                elif line.strip().startswith("launch "):
                    current = line.strip()
                if not line.startswith(("BEGIN ", "END ", "ROW|")):
                    print(line, flush=True)
        now = time.time()
        if not eof and (now - last > IDLE_S or now - t0 > TOTAL_S):
            why = "silent" if now - last > IDLE_S else "over the total cap"
            print(f"!! WATCHDOG: child {why} ({now - last:.0f}s since output) while running "
                  f"{current!r}: killed (likely a hung kernel)", flush=True)
            p.kill()
            p.wait()
            return lines, current or "?"
    p.wait()
    if p.returncode != 0 or "CHILD DONE" not in lines:
        print(f"!! child exited with status {p.returncode}", flush=True)
        return lines, current or "?"
    return lines, None


def main():
    args = sys.argv[1:]
    if args and args[0] == "--child":
        return child_main(args[1:])
    quick = "--quick" in args
    t0 = time.time()
    status = 0
    correctness = "skipped"
    if "--skip-correctness" not in args:
        print("=" * 100)
        print("(a) correctness vs fp32 reference (error <= 2x the Triton kernel's)")
        lines, hung = run_child(["correctness"])
        ok = any(line.startswith("RESULT correctness ok") for line in lines)
        if hung is not None:
            print(f"!! correctness child did not finish (in {hung!r})")
        status |= not ok
        correctness = "ok" if ok else "FAILED"
        print(f"correctness: {correctness}  [{time.time() - t0:.0f}s]")
    if "--skip-timing" in args:
        return status
    print("=" * 100)
    print(f"(b) timing, bf16, {ROUNDS} interleaved rounds, median")
    rows, skip, done = {}, [], []
    for _ in range(3):
        lines, hung = run_child(["timing", "1" if quick else "0", ",".join(skip), ";".join(done)])
        for line in lines:
            if line.startswith("ROW|"):
                _, case, name, tf = line.split("|")
                rows.setdefault(case, {})[name] = float(tf)
            elif line.startswith("CASE DONE "):
                done.append(line[len("CASE DONE "):])
        if hung is None:
            break
        status = 1
        if hung in ("?", "cudnn") or hung in skip:
            print(f"!! timing child failed in {hung!r}; not retrying")
            break
        # a Gluon hang takes every Gluon column out (same kernel, same barrier protocol)
        gone = ["longctx", "gluon-dev", "dense8"] if hung in ("longctx", "gluon-dev", "dense8") \
            else [hung]
        print(f"!! timing: {hung!r} hung or crashed; re-running the remaining cases without {gone}")
        skip += gone
    names = ["cudnn", "longctx", "triton", "gluon-dev", "dense8"]
    print("summary, TFLOPS (4*Hq*S^2*D per sequence / t, causal halved); longctx = as "
          "dispatched (Gluon where hopper_kernel_applies, else Triton); gluon-dev = the Gluon "
          "kernel on device-side descriptors (B = 1); dense8 = longctx on 8 x 8192 dense rows; "
          "lc/cudnn, lc/triton, dev/host (gluon-dev / longctx), var/dense8 (longctx / dense8)")
    print(f"   {'case':<26}" + "".join(f"{n:>11}" for n in names)
          + f"{'lc/cudnn':>10}{'lc/triton':>10}{'dev/host':>10}{'var/dense8':>11}")
    for case, row in rows.items():
        def ratio(a, b, w=10):
            return f"{row[a] / row[b]:{w}.3f}" if a in row and b in row else f"{'-':>{w}}"
        print(f"   {case:<26}" + "".join(f"{row[n]:11.1f}" if n in row else f"{'-':>11}"
                                        for n in names)
              + ratio("longctx", "cudnn") + ratio("longctx", "triton")
              + ratio("gluon-dev", "longctx") + ratio("longctx", "dense8", 11))
    if skip:
        print(f"HUNG / crashed variants (watchdog): {skip}")
    print(f"correctness: {correctness}; total {time.time() - t0:.0f}s")
    return status


if __name__ == "__main__":
    sys.exit(main())
