"""GPU check of the warp-specialized Gluon attention spike (fa_ws.py); needs an sm_90 GPU.

Run from the repo root:
    .venv/bin/python bench/experiments/gluon_fa_hopper_ws/check_ws.py [--configs A,B,...] [--quick]
(default configs: DEFAULT_TIMED below; --quick: correctness, then timing at N = 16384 only)

The parent process only orchestrates. Every GPU step runs in a child process (this script with
--child ...) under a watchdog: a child that prints nothing for IDLE_S seconds (a hung kernel:
mbarrier deadlock) is killed, the config it was running is reported HUNG and dropped, and the
remaining work is restarted in a fresh child. Kernel launches print a line before and after,
so the watchdog sees progress.

(a) correctness, non-causal, vs an fp32 torch reference next to longctx.attention's own error:
    S = 128, 256, 384, 1024, 4096 (1, 2, 3, 8, 32 key tiles) x GQA (8, 2) and (4, 4), bf16;
    plus fp16 (1, 256, 8, 2) and batch 2 (2, 1024, 8, 8). 'ok' = finite and within 1.5x
    longctx's error + (1e-3 on o, 1e-4 on lse) (absolute 2e-2 / 1e-3 without longctx).
    The first launch of each specialisation prints the compiled kernel's registers / spills
    (n_regs of a warp-specialized kernel is the kernel-wide .maxnreg, 168; the consumer
    partitions run at 240 via setmaxnreg: see compile_ws.py for the per-partition numbers).
(b) timing, bf16, B = 1, D = 128, non-causal, (Hq, Hkv) in (16, 2), (32, 32) x N in 4096,
    16384, 65536: cuDNN (SDPA, SDPBackend.CUDNN_ATTENTION), longctx.attention and every config
    that passed (a), interleaved, ROUNDS rounds, median of the round medians
    (triton.testing.do_bench, rep 50 ms, L2 flushed; calls > 20 ms: 1 warm-up + 3 timed calls).
    TFLOPS = 4 * B * Hq * N * N * D / t. Then a summary table.
Expected runtime on an H100 (not measured): ~2-3 min, mostly compiles.
"""
import math
import os
import select
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TIMED = ["ws_n128_s2", "ws_n128_s3", "ws_n128_s2_nopp", "wsu_n128_s2"]
IDLE_S = 75          # watchdog: a child silent this long is considered hung
TOTAL_S = 600        # hard cap per child
ROUNDS = 3
REP_MS = 50
LONG_CALL_MS = 20.0
CORRECTNESS_SHAPES = ([(1, S, hq, hkv, "bf16") for S in (128, 256, 384, 1024, 4096)
                       for (hq, hkv) in ((8, 2), (4, 4))]
                      + [(1, 256, 8, 2, "fp16"), (2, 1024, 8, 8, "bf16")])


def say(*a):
    print(*a, flush=True)


def short(e):
    msg = str(e).strip().splitlines()
    return f"FAILED {type(e).__name__}: {msg[-1] if msg else ''}"[:300]


# =============================================================================================
# child side (GPU)
# =============================================================================================
def child_imports():
    global torch, triton, fa_ws, longctx
    import torch
    import triton
    sys.path.insert(0, HERE)
    import fa_ws
    try:
        import longctx
    except Exception as e:  # noqa: BLE001
        longctx = None
        say("import longctx failed:", repr(e))


def make(B, S, Hq, Hkv, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, S, Hq, 128, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, S, Hkv, 128, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, S, Hkv, 128, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def reference(q, k, v, scale):
    g = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(g, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(g, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(torch.softmax(s, dim=-1), vf)
    return o.transpose(1, 2).contiguous(), lse


def errs(o, lse, o_ref, lse_ref):
    eo = (o.float() - o_ref).abs().max().item()
    el = (lse.float() - lse_ref).abs().max().item()
    fin = bool(torch.isfinite(o.float()).all().item() and torch.isfinite(lse).all().item())
    return eo, el, fin


_reported = set()


def kernel_report(config, tag):
    k = fa_ws.LAST_KERNEL
    key = (config, tag)
    if k is None or key in _reported:
        return
    _reported.add(key)
    try:
        say(f"      [{config} {tag}] n_regs {k.n_regs} (kernel-wide .maxnreg) spills {k.n_spills} "
            f"shared {k.metadata.shared} B warps {k.metadata.num_warps}")
    except Exception as e:  # noqa: BLE001
        say(f"      [{config} {tag}] report {short(e)}")


def child_correctness(configs):
    """Prints 'BEGIN <config>' before the launches of a config and 'RESULT <config> ok|bad' after."""
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}
    cases = []
    for (B, S, Hq, Hkv, dts) in CORRECTNESS_SHAPES:
        say(f"   reference + longctx for B={B} S={S} Hq={Hq} Hkv={Hkv} {dts}")
        q, k, v = make(B, S, Hq, Hkv, dt[dts])
        scale = 1.0 / math.sqrt(128)
        o_ref, lse_ref = reference(q, k, v, scale)
        lc = None
        if longctx is not None:
            try:
                o, lse = longctx.attention(q, k, v, causal=False, return_lse=True)
                torch.cuda.synchronize()
                lc = errs(o, lse, o_ref, lse_ref)
            except Exception as e:  # noqa: BLE001
                say(f"   longctx.attention on {(B, S, Hq, Hkv, dts)}: {short(e)}")
        cases.append(((B, S, Hq, Hkv, dts), (q, k, v), (o_ref, lse_ref), lc))
    for config in configs:
        say(f"BEGIN {config}")
        n_bad = 0
        for shape, (q, k, v), (o_ref, lse_ref), lc in cases:
            B, S, Hq, Hkv, dts = shape
            label = f"B={B} S={S} Hq={Hq} Hkv={Hkv} {dts}"
            try:
                say(f"   launch {config} {label}")
                t0 = time.time()
                o, lse = fa_ws.ws_attention(q, k, v, config=config)
                torch.cuda.synchronize()
                eo, el, fin = errs(o, lse, o_ref, lse_ref)
                if lc is not None:
                    ok = fin and eo <= 1.5 * lc[0] + 1e-3 and el <= 1.5 * lc[1] + 1e-4
                    ref = f"(longctx o {lc[0]:.2e} lse {lc[1]:.2e})"
                else:
                    ok = fin and eo <= 2e-2 and el <= 1e-3
                    ref = "(no longctx)"
                n_bad += not ok
                say(f"   {config:<18} {label:<28} o {eo:.3e} lse {el:.3e} finite={fin} {ref} "
                    f"{'ok' if ok else 'BAD'} ({time.time() - t0:.1f}s incl. compile)")
                kernel_report(config, f"{dts} {'g1' if Hq == Hkv else 'gqa'} S={S}")
            except Exception as e:  # noqa: BLE001
                n_bad += 1
                say(f"   {config:<18} {label:<28} {short(e)}")
                if os.environ.get("VERBOSE"):
                    traceback.print_exc()
        say(f"RESULT {config} {'ok' if n_bad == 0 else 'bad'} ({n_bad} bad rows)")


def sdpa_cudnn(q, k, v):
    from torch.nn.attention import sdpa_kernel, SDPBackend
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = q.shape[2] != k.shape[2]

    def fn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=gqa)
    return fn


def bench(fn):
    fn()
    torch.cuda.synchronize()
    cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    triton.runtime.driver.active.clear_cache(cache)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    est = s.elapsed_time(e)
    if est <= LONG_CALL_MS:
        return triton.testing.do_bench(fn, warmup=10, rep=REP_MS, return_mode="median")
    times = [est]
    for _ in range(max(2, int(REP_MS / est))):
        triton.runtime.driver.active.clear_cache(cache)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def child_timing(configs, quick):
    """Prints 'BEGIN <config>' around every first launch of a config in a case (the watchdog's
    attribution) and 'ROW ...' lines that the parent collects into the summary."""
    say(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    seqs = (16384, ) if quick else (4096, 16384, 65536)
    for (Hq, Hkv) in ((16, 2), (32, 32)):
        for N in seqs:
            q, k, v = make(1, N, Hq, Hkv, torch.bfloat16, seed=1)
            flops = 4.0 * Hq * N * N * 128
            variants = [("cudnn", sdpa_cudnn(q, k, v))]
            if longctx is not None:
                variants.append(("longctx", lambda: longctx.attention(q, k, v, causal=False)))
            for c in configs:
                variants.append((c, lambda c=c: fa_ws.ws_attention(q, k, v, config=c)))
            say(f"-- Hq={Hq} Hkv={Hkv} N={N}")
            ref = None
            if longctx is not None:
                try:
                    ref = longctx.attention(q, k, v, causal=False, return_lse=True)
                except Exception as e:  # noqa: BLE001
                    say(f"   longctx reference {short(e)}")
            live = []
            for name, fn in variants:
                try:
                    say(f"BEGIN {name}")
                    out = fn()
                    torch.cuda.synchronize()
                    if ref is not None and name not in ("cudnn", "longctx"):
                        o, lse = out
                        say(f"   {name:<18} vs longctx: max|do| {(o.float() - ref[0].float()).abs().max().item():.3e}"
                            f" max|dlse| {(lse - ref[1]).abs().max().item():.3e}")
                    live.append((name, fn))
                except Exception as e:  # noqa: BLE001
                    say(f"   {name:<18} first call {short(e)}")
                say(f"END {name}")
            del ref
            times = {n: [] for n, _ in live}
            for _ in range(ROUNDS):
                for name, fn in live:
                    try:
                        say(f"BEGIN {name}")
                        times[name].append(bench(fn))
                        say(f"END {name}")
                    except Exception as e:  # noqa: BLE001
                        say(f"   {name}: {short(e)}")
            base = None
            for name, _ in live:
                ts = times[name]
                if not ts:
                    continue
                med = statistics.median(ts)
                base = med if name == "cudnn" else base
                rel = f"  x{base / med:.3f} cudnn" if base else ""
                say(f"   {name:<18} {med:9.3f} ms {flops / med / 1e9:7.1f} TF  rounds "
                    f"[{', '.join(f'{t:.3f}' for t in ts)}]{rel}")
                say(f"ROW {Hq}/{Hkv} {N} {name} {flops / med / 1e9:.1f}")
            del q, k, v
            torch.cuda.empty_cache()


def child_main(argv):
    mode, configs = argv[0], [c for c in argv[1].split(",") if c]
    child_imports()
    assert torch.cuda.is_available(), "needs a CUDA GPU (sm_90)"
    say("capability:", torch.cuda.get_device_capability())
    if mode == "correctness":
        child_correctness(configs)
    else:
        child_timing(configs, quick=argv[2] == "1")
    say("CHILD DONE")


# =============================================================================================
# parent side: watchdog
# =============================================================================================
def run_child(args):
    """Run a child, echo its output; returns (lines, hung_in) with hung_in the config named by the
    last unmatched 'BEGIN x' when the watchdog killed it (or '?' / None)."""
    cmd = [sys.executable, "-u", os.path.abspath(__file__), "--child", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    fd = p.stdout.fileno()
    lines, last, t0, current, buf, eof = [], time.time(), time.time(), None, b"", False
    while not eof:
        r, _, _ = select.select([fd], [], [], 5.0)
        if r:
            chunk = os.read(fd, 65536)  # unbuffered: select() and the data we hold stay in sync
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
                elif line.startswith(("END ", "RESULT ")):
                    current = None
                if not line.startswith(("BEGIN ", "END ")):
                    print(line, flush=True)
        now = time.time()
        if not eof and (now - last > IDLE_S or now - t0 > TOTAL_S):
            why = "silent" if now - last > IDLE_S else "over the total cap"
            print(f"!! WATCHDOG: child {why} for {now - last:.0f}s while running {current!r}: killed "
                  f"(likely a hung kernel)", flush=True)
            p.kill()
            p.wait()
            return lines, current or "?"
    p.wait()
    if p.returncode != 0 and "CHILD DONE" not in lines:
        print(f"!! child exited with status {p.returncode}", flush=True)
        return lines, current or "?"
    return lines, None


def main():
    args = sys.argv[1:]
    if args and args[0] == "--child":
        return child_main(args[1:])
    configs = DEFAULT_TIMED
    if "--configs" in args:
        configs = args[args.index("--configs") + 1].split(",")
    quick = "--quick" in args
    t0 = time.time()
    print("=" * 110)
    print("(a) correctness (non-causal) vs fp32 reference")
    passed, hung, todo = [], [], list(configs)
    while todo:
        lines, hung_in = run_child(["correctness", ",".join(todo)])
        for line in lines:
            if line.startswith("RESULT "):
                _, c, verdict = line.split()[:3]
                if c in todo:
                    todo.remove(c)
                if verdict == "ok":
                    passed.append(c)
        if hung_in is not None:
            if hung_in in todo:
                hung.append(hung_in)
                todo.remove(hung_in)
            else:  # died outside any config (imports, reference): give up on the rest
                print(f"!! correctness child failed outside a config; not retrying {todo}")
                break
    print(f"correctness: passed {passed}; hung {hung}; failed "
          f"{[c for c in configs if c not in passed and c not in hung]}  [{time.time() - t0:.0f}s]")
    print("=" * 110)
    print(f"(b) timing, bf16, B=1, D=128, non-causal, {ROUNDS} interleaved rounds, median of round medians")
    rows, timed = {}, list(passed)
    for attempt in range(3):
        lines, hung_in = run_child(["timing", ",".join(timed), "1" if quick else "0"])
        for line in lines:
            if line.startswith("ROW "):
                _, heads, n, name, tf = line.split()
                rows.setdefault((heads, int(n)), {})[name] = float(tf)
        if hung_in is None or hung_in in ("cudnn", "longctx", "?") or hung_in not in timed:
            break
        print(f"!! timing: {hung_in} hung, re-running without it")
        hung.append(hung_in)
        timed.remove(hung_in)
        rows = {}
    names = ["cudnn", "longctx"] + [c for c in configs if c in timed]
    print("summary, TFLOPS (4*B*Hq*N*N*D / t); last column: best ws config / cudnn")
    print(f"   {'Hq/Hkv':<7} {'N':>6}" + "".join(f"{n:>17}" for n in names) + f"{'best/cudnn':>12}")
    for (heads, n), row in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        best = max((row[c] for c in timed if c in row), default=None)
        ratio = f"{best / row['cudnn']:12.3f}" if best and row.get("cudnn") else f"{'-':>12}"
        print(f"   {heads:<7} {n:>6}" + "".join(f"{row[c]:17.1f}" if c in row else f"{'-':>17}" for c in names)
              + ratio)
    if hung:
        print(f"HUNG configs (watchdog): {hung}")
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
