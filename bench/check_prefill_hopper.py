"""GPU check of the library's Hopper prefill path (kernels/prefill_hopper.py); needs an sm_90 GPU.

    python bench/check_prefill_hopper.py [--quick] [--skip-correctness] [--skip-timing]

The parent process only orchestrates. Each GPU section runs in a child process (this script with
--child ...) under a watchdog: a child that prints nothing for IDLE_S seconds (a hung kernel, e.g.
an mbarrier deadlock) or runs past TOTAL_S is killed and reported; the timing section then
re-runs its remaining cases without the variant that hung. Every launch prints a line first, so
the watchdog sees progress and names the culprit.

(a) correctness: longctx.attention / attention_merge_into as dispatched (a counter confirms that
    the Gluon kernel ran) and a few direct hopper_attention_fwd calls (shapes the dispatch keeps
    on Triton: causal with 1..9 key tiles, unmasked with < 512 programs), against an fp32 torch
    reference; 'ok' = finite
    and at most 2x the error of the same call with LONGCTX_PREFILL_KERNEL=triton (+1e-5).
    Accumulate: a state with empty (-inf / NaN) rows, merged with a no-mask Sq != Sk block and
    then the causal diagonal block, against the fp32 reference merged in torch.
(b) timing, bf16, D = 128, B = 1: cuDNN (SDPA, SDPBackend.CUDNN_ATTENTION), longctx.attention as
    dispatched ("longctx") and with LONGCTX_PREFILL_KERNEL=triton ("triton"), interleaved,
    ROUNDS rounds, median of the rounds (triton.testing.do_bench medians, L2 flushed), for
    (Hq, Hkv) in (16, 2), (32, 32) x N in 2048 .. 16384 x causal / not; then the ring's
    rectangular no-mask blocks 8192 x 16384 and 16384 x 8192 at 32/32, plain and accumulate
    (attention_merge_into). TFLOPS = 4 * B * Hq * Sq * Sk * D / t, halved for causal. Where the
    dispatch rule (kernels/prefill.py) declines, both longctx columns run the Triton kernel.
Runtime on an H100: ~1.5 minutes.
"""
import os
import select
import statistics
import subprocess
import sys
import time

IDLE_S = 60          # watchdog: a child silent this long is considered hung
TOTAL_S = 300        # hard cap per child
ROUNDS = 3
REP_MS = 40
ENV = "LONGCTX_PREFILL_KERNEL"
TIMED_HEADS = ((16, 2), (32, 32))
TIMED_N = (2048, 4096, 8192, 16384)
RECT = ((8192, 16384), (16384, 8192))


def say(*a):
    print(*a, flush=True)


def short(e):
    msg = str(e).strip().splitlines()
    return f"FAILED {type(e).__name__}: {msg[-1] if msg else ''}"[:300]


# =============================================================================================
# child side (GPU)
# =============================================================================================
def child_imports():
    global torch, triton, longctx, PH, reference_attention, merge_states_torch
    import torch
    import triton

    import longctx
    import longctx.kernels.prefill_hopper as PH
    from longctx.merge import merge_states_torch
    from longctx.reference import reference_attention


class GluonCounter:
    """Counts hopper_attention_fwd calls made by the dispatch (module attribute wrapped)."""

    def __init__(self):
        self.n, self.real = 0, PH.hopper_attention_fwd

        def counted(*a, **kw):
            self.n += 1
            return self.real(*a, **kw)
        PH.hopper_attention_fwd = counted


def set_kernel(choice):
    if choice == "triton":
        os.environ[ENV] = "triton"
    else:
        os.environ.pop(ENV, None)


def rand(shape, dtype, g):
    return torch.randn(*shape, device="cuda", dtype=torch.float32, generator=g).to(dtype)


def reference(q, k, v, scale, causal):
    """The project's reference attention in fp32: o [B, Sq, Hq, D] float32, lse [B, Hq, Sq]."""
    return reference_attention(q.float(), k.float(), v.float(), causal=causal,
                               softmax_scale=scale)


def merge_ref(o_acc, lse_acc, o, lse):
    """merge_into's rule (the merge layer's torch merge): state [B, Sq, Hq, D] / [B, Sq, Hq],
    part o [B, Sq, Hq, D] / lse [B, Hq, Sq]."""
    return merge_states_torch(torch.stack([o_acc, o]), torch.stack([lse_acc, lse.transpose(1, 2)]))


def verdict(name, errs, ref_errs, finite, counted):
    ok = finite and all(e <= 2 * r + 1e-5 for e, r in zip(errs, ref_errs)) and counted
    say(f"   {name:<58} o {errs[0]:.2e} lse {errs[1]:.2e} | triton o {ref_errs[0]:.2e} "
        f"lse {ref_errs[1]:.2e} | gluon ran: {counted} finite: {finite}  {'ok' if ok else 'BAD'}")
    return ok


def child_correctness():
    counter = GluonCounter()
    g = torch.Generator(device="cuda").manual_seed(0)
    n_bad = 0
    # (B, Sq, Sk, Hq, Hkv, dtype, causal, direct)
    cases = [(1, 4096, 1024, 16, 2, "bf16", False, False),
             (2, 512, 512, 8, 8, "bf16", False, True),
             (1, 384, 2048, 12, 4, "fp16", False, True),
             (1, 1024, 128, 8, 2, "bf16", False, True),
             (1, 4224, 4224, 4, 2, "bf16", True, False), (1, 8192, 8192, 4, 1, "fp16", True, False),
             (2, 128, 128, 4, 2, "bf16", True, True), (2, 1152, 1152, 6, 2, "fp16", True, True)]
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}
    for (b, sq, sk, hq, hkv, dts, causal, direct) in cases:
        name = (f"{'direct' if direct else 'dispatch'} B={b} {sq}x{sk} {hq}/{hkv} {dts} "
                f"{'causal' if causal else 'full'}")
        try:
            q = rand((b, sq, hq, 128), dt[dts], g)
            k, v = rand((b, sk, hkv, 128), dt[dts], g), rand((b, sk, hkv, 128), dt[dts], g)
            scale = 128 ** -0.5
            o_ref, lse_ref = reference(q, k, v, scale, causal)
            say(f"   launch {name}")
            n0 = counter.n
            set_kernel("auto")
            if direct:
                o, lse = PH.hopper_attention_fwd(q, k, v, softmax_scale=scale, causal=causal,
                                                 q_start=0, k_start=0)
                counted = True
            else:
                o, lse = longctx.attention(q, k, v, causal=causal, return_lse=True)
                counted = counter.n == n0 + 1
            torch.cuda.synchronize()
            set_kernel("triton")
            o_t, lse_t = longctx.attention(q, k, v, causal=causal, return_lse=True)
            set_kernel("auto")
            err = lambda o_, l_: ((o_.float() - o_ref).abs().max().item(),  # noqa: E731
                                  (l_ - lse_ref).abs().max().item())
            finite = bool(torch.isfinite(o.float()).all() and torch.isfinite(lse).all())
            n_bad += not verdict(name, err(o, lse), err(o_t, lse_t), finite, counted)
        except Exception as e:  # noqa: BLE001
            n_bad += 1
            say(f"   {name}: {short(e)}")
    # accumulate: a ring rank's two steps into a state with empty rows
    for (sq, sk_other, hq, hkv, dts) in ((4224, 2048, 16, 2, "bf16"), (4608, 128, 16, 4, "fp16")):
        name = f"accumulate {sq}x{sk_other} full + {sq}x{sq} causal {hq}/{hkv} {dts}"
        try:
            q = rand((1, sq, hq, 128), dt[dts], g)
            kv = [(rand((1, s, hkv, 128), dt[dts], g), rand((1, s, hkv, 128), dt[dts], g), c)
                  for s, c in ((sk_other, False), (sq, True))]
            o0 = torch.randn(1, sq, hq, 128, device="cuda", generator=g)
            l0 = torch.randn(1, sq, hq, device="cuda", generator=g) * 3
            o0[:, 1::2], l0[:, 1::2] = float("nan"), float("-inf")
            ref = (o0.nan_to_num(0.0), l0.clone())
            for k, v, c in kv:
                ref = merge_ref(*ref, *reference(q, k, v, 128 ** -0.5, c))
            states = {}
            for choice in ("auto", "triton"):
                set_kernel(choice)
                st = (o0.clone(), l0.clone())
                n0 = counter.n
                say(f"   launch {name} [{choice}]")
                for k, v, c in kv:
                    longctx.attention_merge_into(*st, q, k, v, causal=c)
                torch.cuda.synchronize()
                states[choice] = (st, counter.n - n0)
            set_kernel("auto")
            err = lambda st: ((st[0] - ref[0]).abs().max().item(),  # noqa: E731
                              (st[1] - ref[1]).abs().max().item())
            (st_g, n_g), (st_t, _) = states["auto"], states["triton"]
            finite = bool(torch.isfinite(st_g[0]).all() and torch.isfinite(st_g[1]).all())
            n_bad += not verdict(name, err(st_g), err(st_t), finite, n_g == 2)
        except Exception as e:  # noqa: BLE001
            n_bad += 1
            say(f"   {name}: {short(e)}")
    say(f"RESULT correctness {'ok' if n_bad == 0 else 'BAD'} ({n_bad} bad)")


def sdpa_cudnn(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = q.shape[2] != k.shape[2]

    def fn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                    enable_gqa=gqa)
    return fn


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=REP_MS, return_mode="median")


def timing_cases(quick):
    ns = (16384,) if quick else TIMED_N
    cases = [(hq, hkv, n, n, c) for (hq, hkv) in TIMED_HEADS for n in ns for c in (False, True)]
    return cases + [(32, 32, sq, sk, False) for sq, sk in RECT]


def case_id(c):
    hq, hkv, sq, sk, causal = c
    return f"{hq}/{hkv} {sq}x{sk} {'causal' if causal else 'full'}"


def child_timing(todo, skip):
    say(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"triton {triton.__version__}")
    g = torch.Generator(device="cuda").manual_seed(1)
    for c in todo:
        hq, hkv, sq, sk, causal = c
        q = rand((1, sq, hq, 128), torch.bfloat16, g)
        k, v = (rand((1, sk, hkv, 128), torch.bfloat16, g) for _ in range(2))
        flops = 4.0 * hq * sq * sk * 128 / (2 if causal else 1)
        o_acc = torch.zeros(1, sq, hq, 128, device="cuda")
        lse_acc = torch.full((1, sq, hq), float("-inf"), device="cuda")

        def run(acc):
            if acc:
                return lambda: longctx.attention_merge_into(o_acc, lse_acc, q, k, v, causal=causal)
            return lambda: longctx.attention(q, k, v, causal=causal)
        # (name, fn, LONGCTX_PREFILL_KERNEL choice: set before timing, read by every call)
        variants = [("cudnn", sdpa_cudnn(q, k, v, causal), "auto"),
                    ("longctx", run(False), "auto"), ("triton", run(False), "triton")]
        if (sq, sk) in RECT and not causal:
            variants += [("longctx-acc", run(True), "auto"), ("triton-acc", run(True), "triton")]
        variants = [v_ for v_ in variants if v_[0] not in skip]
        say(f"-- CASE {case_id(c)}")
        times = {n: [] for n, _, _ in variants}
        for _ in range(ROUNDS):
            for name, fn, choice in variants:
                try:
                    say(f"BEGIN {name}")
                    set_kernel(choice)
                    times[name].append(bench(fn))
                    say(f"END {name}")
                except Exception as e:  # noqa: BLE001
                    say(f"END {name}")
                    say(f"   {name}: {short(e)}")
        set_kernel("auto")
        for name, _, _ in variants:
            if times[name]:
                med = statistics.median(times[name])
                say(f"   {name:<12} {med:9.3f} ms {flops / med / 1e9:7.1f} TF  rounds "
                    f"[{', '.join(f'{t:.3f}' for t in times[name])}]")
                say(f"ROW|{case_id(c)}|{name}|{flops / med / 1e9:.1f}")
        say(f"CASE DONE {case_id(c)}")
        del q, k, v, o_acc, lse_acc
        torch.cuda.empty_cache()


def child_main(argv):
    child_imports()
    assert torch.cuda.get_device_capability() == (9, 0), "needs an sm_90 GPU"
    if argv[0] == "correctness":
        child_correctness()
    else:
        quick, skip = argv[1] == "1", [s for s in argv[2].split(",") if s]
        done = set(argv[3].split(";")) if len(argv) > 3 else set()
        child_timing([c for c in timing_cases(quick) if case_id(c) not in done], skip)
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
    if "--skip-correctness" not in args:
        print("=" * 100)
        print("(a) correctness vs fp32 reference (error <= 2x the Triton kernel's)")
        lines, hung = run_child(["correctness"])
        ok = any(line.startswith("RESULT correctness ok") for line in lines)
        if hung is not None:
            print(f"!! correctness child did not finish (in {hung!r})")
        status |= not ok
        print(f"correctness: {'ok' if ok else 'FAILED'}  [{time.time() - t0:.0f}s]")
    if "--skip-timing" in args:
        return status
    print("=" * 100)
    print(f"(b) timing, bf16, B=1, D=128, {ROUNDS} interleaved rounds, median")
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
        # a Gluon hang takes both Gluon columns out (same kernel, same barrier protocol)
        gone = ["longctx", "longctx-acc"] if hung.startswith("longctx") else [hung]
        print(f"!! timing: {hung!r} hung or crashed; re-running the remaining cases without {gone}")
        skip += gone
    names = ["cudnn", "longctx", "triton", "longctx-acc", "triton-acc"]
    print("summary, TFLOPS (4*B*Hq*Sq*Sk*D / t, causal halved); longctx = as dispatched "
          "(Gluon where hopper_kernel_applies, else Triton); last columns: longctx / cudnn, "
          "longctx / triton")
    print(f"   {'case':<28}" + "".join(f"{n:>13}" for n in names)
          + f"{'lc/cudnn':>10}{'lc/triton':>10}")
    for case, row in rows.items():
        ratio = lambda a, b: (f"{row[a] / row[b]:10.3f}" if a in row and b in row  # noqa: E731
                              else f"{'-':>10}")
        r1, r2 = ratio("longctx", "cudnn"), ratio("longctx", "triton")
        print(f"   {case:<28}"
              + "".join(f"{row[n]:13.1f}" if n in row else f"{'-':>13}" for n in names)
              + r1 + r2)
    if skip:
        print(f"HUNG / crashed variants (watchdog): {skip}")
    print(f"total {time.time() - t0:.0f}s")
    return status


if __name__ == "__main__":
    sys.exit(main())
