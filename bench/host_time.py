"""Eager calls of the public API against SDPA: host time per call, eager wall time per call and the
CUDA-graph replay time beside them. One command on a GPU machine:

    python bench/host_time.py                   # decode seed shapes + three prefill shapes
    python bench/host_time.py --decode 1x65536 --prefill 2048 --calls 100
    python bench/host_time.py --stub            # CPU only: the fast path's Python side, in parts

Implementations, each on the same inputs: longctx with fast launches (the default), longctx
with Triton's generic launch path (`fast_launch(False)`, the A/B baseline), decode with the
merge of the splits fused into the split kernel and as a second launch at every shape
(`longctx_fused`, `longctx_separate`; the default fuses up to 4 splits), SDPA with the flash
and the cuDNN backends (on their preferred [B, H, S, D] layout). Decode: configs/bench.yaml's
decode case (fp16, 16 query / 2 KV heads, D=128, all sequences full, `cache_seqlens` given).
Prefill: bf16, batch 1, 16 query / 2 KV heads, D=128, causal, --prefill rows; longctx also with
LONGCTX_PREFILL_KERNEL=triton (its default dispatch runs the Gluon kernel on sm_90 where that
applies). Backend and launch-path switches are set once around a measurement, not per call.

Per implementation and shape, µs per call:
  host   the CPU time of one call while the GPU is held busy (a `torch.cuda._sleep` kernel queued
         first, long enough for all --calls calls): what the call costs the caller's thread,
         never waiting on the GPU, with Python's garbage collector off (as `timeit`). Minimum
         over 7 rounds, each running every implementation once, so that a slow spell of the
         host (other tenants, clocks) falls on all of them alike.
  eager  --calls back-to-back calls and a synchronize, per call: what an eager loop runs at,
         max(host, GPU) plus the gaps between. Median over the same 7 rounds.
  graph  the same calls captured in one CUDA graph, replayed, per call: the GPU time of a call
         with the launch cost removed. Median over 7 repetitions.
The targets (BENCHMARKS.md, Eager API host cost) are checked in the last columns: longctx decode host <= 20 µs, eager
within 10% of graph where graph > host, longctx attention host <= SDPA cuDNN host.
Writes host-time[-tag].json to $OUT if set, else bench/results/raw/ (untracked); prints the table last.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without `pip install -e .`, too
sys.path.insert(0, str(ROOT / "launch"))  # launch/bench.py's timing helpers

REPS = 7


# ------------------------------------------------------------------------------------ measurement
def _cycles_per_ms() -> float:
    """Clock of `torch.cuda._sleep`'s spin loop, measured."""
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(50_000_000)
    e.record()
    torch.cuda.synchronize()
    return 50_000_000 / s.elapsed_time(e)


def host_us(fn: Callable[[], object], calls: int, cycles_per_ms: float) -> float:
    """CPU µs per call of `calls` calls with the GPU held busy, so that no call waits for it;
    Python's garbage collector off, as `timeit` runs (one full collection would add ms)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    one = time.perf_counter() - t  # an upper bound for one call's host time
    torch.cuda._sleep(int(cycles_per_ms * max(20.0, 3e3 * one * calls)))
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t) / calls * 1e6
    finally:
        if gc_was_on:
            gc.enable()
        torch.cuda.synchronize()


def eager_us(fn: Callable[[], object], calls: int) -> float:
    """Wall µs per call of `calls` back-to-back calls and a synchronize."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def graph_us(fn: Callable[[], object], calls: int) -> float:
    """µs per call of `calls` calls captured in one CUDA graph and replayed (median over REPS)."""
    from bench import capture_graph  # launch/bench.py

    g = capture_graph(fn, calls)
    g.replay()
    times = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del g
    return statistics.median(times)


def measure(fn: Callable[[], object], calls: int) -> dict:
    """graph_us of fn (host and eager times are measured across implementations: `_measure_row`)."""
    fn()
    torch.cuda.synchronize()
    try:
        return {"graph_us": graph_us(fn, calls)}
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        torch.cuda.synchronize()
        return {"graph_us": None, "graph_note": f"{type(e).__name__}: {str(e)[:100]}"}


# ------------------------------------------------------------------------------------ cases
@contextlib.contextmanager
def _decode_merge(value: str):
    """Decode plans made inside merge their splits `value` ("fused" or "separate")."""
    import longctx.kernels.decode as kd

    api = importlib.import_module("longctx.decode")  # the module (longctx.decode is the function)
    prev, kd.DECODE_MERGE = kd.DECODE_MERGE, value
    api._PLANS.clear()
    try:
        yield
    finally:
        kd.DECODE_MERGE = prev
        api._PLANS.clear()


def _implementations(kind: str) -> dict[str, Callable]:
    """name -> (inputs) -> (call, context): the context (a backend or launch-path switch) is
    entered once around a whole measurement, as a caller sets it once, not per call."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import longctx
    from longctx.kernels.launch import fast_launch

    none = contextlib.nullcontext
    if kind == "decode":
        def ours(t):
            return lambda: longctx.decode(t["q"], t["k"], t["v"], cache_seqlens=t["lens"])

        def sdpa(t):
            return lambda: F.scaled_dot_product_attention(t["q4"], t["k_t"], t["v_t"], enable_gqa=True)
    else:
        def ours(t):
            return lambda: longctx.attention(t["q"], t["k"], t["v"], causal=True)

        def sdpa(t):
            return lambda: F.scaled_dot_product_attention(t["q_t"], t["k_t"], t["v_t"],
                                                          is_causal=True, enable_gqa=True)
    impls = {
        "longctx": lambda t: (ours(t), none),
        "longctx_generic": lambda t: (ours(t), lambda: fast_launch(False)),
        "sdpa_flash": lambda t: (sdpa(t), lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
        "sdpa_cudnn": lambda t: (sdpa(t), lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)),
    }
    if kind == "decode":  # the default fuses the merge of few splits: both ways at every shape
        impls["longctx_fused"] = lambda t: (ours(t), lambda: _decode_merge("fused"))
        impls["longctx_separate"] = lambda t: (ours(t), lambda: _decode_merge("separate"))
    if kind == "prefill":
        from longctx.kernels.prefill import prefill_kernel

        impls["longctx_triton"] = lambda t: (ours(t), lambda: prefill_kernel("triton"))
    return impls


def _decode_config() -> dict:
    import yaml

    cfg = yaml.safe_load((ROOT / "configs" / "bench.yaml").read_text())["decode"]
    return cfg


def run_decode(shapes: list[tuple[int, int]], calls: int, cpm: float) -> list[dict]:
    cfg = _decode_config()
    dtype = getattr(torch, cfg["dtype"])
    Hq, Hkv, D = cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"]
    impls = _implementations("decode")
    rows = []
    for B, N in shapes:
        q = torch.randn(B, Hq, D, device="cuda", dtype=dtype)
        k = torch.randn(B, N, Hkv, D, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        t = dict(q=q, k=k, v=v, lens=torch.full((B,), N, device="cuda", dtype=torch.int32),
                 q4=q[:, :, None], k_t=k.transpose(1, 2).contiguous(), v_t=v.transpose(1, 2).contiguous())
        rows.append(_measure_row({"case": "decode", "shape": f"{B}x{N}", "batch": B, "kv_len": N},
                                 impls, t, calls, cpm))
        del q, k, v, t
    return rows


def run_prefill(lengths: list[int], calls: int, cpm: float) -> list[dict]:
    Hq, Hkv, D, dtype = 16, 2, 128, torch.bfloat16
    impls = _implementations("prefill")
    rows = []
    for S in lengths:
        q = torch.randn(1, S, Hq, D, device="cuda", dtype=dtype)
        k = torch.randn(1, S, Hkv, D, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        t = dict(q=q, k=k, v=v, q_t=q.transpose(1, 2).contiguous(), k_t=k.transpose(1, 2).contiguous(),
                 v_t=v.transpose(1, 2).contiguous())
        n = max(5, min(calls, int(calls * 2048 / S)))  # fewer calls for the longer ones
        rows.append(_measure_row({"case": "prefill", "shape": f"1x{S}", "seq_len": S}, impls, t, n,
                                 cpm))
        del q, k, v, t
    return rows


def _measure_row(row: dict, impls: dict, t: dict, calls: int, cpm: float) -> dict:
    """Every implementation on inputs t into row (a peer that cannot run is noted); prints it.
    Host and eager times come from REPS rounds, each running every implementation once, so that
    a slow spell of the host falls on all of them alike: host the minimum, eager the median."""
    made = {}
    for name, make in impls.items():
        try:
            fn, context = make(t)
            with context():
                row[name] = measure(fn, calls)
            made[name] = (fn, context)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            torch.cuda.synchronize()
            row[name] = {"note": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
    rounds = {name: ([], []) for name in made}
    for _ in range(REPS):
        for name, (fn, context) in made.items():
            with context():
                rounds[name][0].append(host_us(fn, calls, cpm))
                rounds[name][1].append(eager_us(fn, calls))
    for name, (host, eager) in rounds.items():
        row[name].update(host_us=min(host), eager_us=statistics.median(eager))
    print(_fmt(row), flush=True)
    torch.cuda.empty_cache()
    return row


# ------------------------------------------------------------------------------------ report
_COLS = ("longctx", "longctx_generic", "longctx_fused", "longctx_separate", "longctx_triton",
         "sdpa_flash", "sdpa_cudnn")


def _num(x) -> str:
    return f"{x:7.1f}" if isinstance(x, (int, float)) else f"{'-':>7}"


def _fmt(row: dict) -> str:
    parts = [f"{row['case']:>7} {row['shape']:>9}"]
    for c in _COLS:
        if c in row:
            r = row[c]
            parts.append(f"{c}: host {_num(r.get('host_us'))} eager {_num(r.get('eager_us'))} "
                         f"graph {_num(r.get('graph_us'))}")
    return " | ".join(parts)


def targets(row: dict) -> dict:
    """The targets for one row (None where a number is missing)."""
    ours, cudnn = row.get("longctx", {}), row.get("sdpa_cudnn", {})
    host, eager, graph = ours.get("host_us"), ours.get("eager_us"), ours.get("graph_us")
    out = {}
    if row["case"] == "decode" and host is not None:
        out["host_le_20us"] = host <= 20.0
    if None not in (host, eager, graph) and graph > host:
        out["eager_within_10pct_of_graph"] = eager <= 1.10 * graph
    if row["case"] == "prefill" and host is not None and cudnn.get("host_us") is not None:
        out["host_le_cudnn"] = host <= cudnn["host_us"]
    return out


def print_table(rows: list[dict], device: str) -> None:
    print(f"\n{device}; µs per call: host (GPU held busy) / eager (back-to-back) / graph (replayed)")
    names = [c for c in _COLS if any(c in r for r in rows)]
    head = f"{'case':>7} {'shape':>9} | " + " | ".join(f"{n:^23}" for n in names) + " | targets"
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = []
        for n in names:
            m = r.get(n, {})
            cells.append(f"{_num(m.get('host_us'))} {_num(m.get('eager_us'))} {_num(m.get('graph_us'))}")
        t = targets(r)
        mark = " ".join(f"{k}={'ok' if v else 'MISS'}" for k, v in t.items())
        print(f"{r['case']:>7} {r['shape']:>9} | " + " | ".join(cells) + f" | {mark}")


# ------------------------------------------------------------------------------------ CPU stub
def stub_breakdown(shape: tuple[int, int], n: int = 20000) -> dict:
    """The fast path's Python side on a CPU, launches stubbed (no GPU, no interpreter): µs per
    part of one longctx.decode call. CPU torch.empty stands in for CUDA's caching allocator (on
    a GPU host each CUDA allocation and each C launch costs more than here)."""
    os.environ.pop("TRITON_INTERPRET", None)
    import longctx
    import longctx.backend as backend
    from longctx.kernels import launch as L
    from longctx.kernels.utils import pdl_allowed

    api = importlib.import_module("longctx.decode")
    L.current_device = lambda: 0
    L._stream = lambda device: 0
    L._capturing = lambda: False
    L._scratch_device = lambda device: torch.device("cpu")
    launched = []
    L._fetch_binary = lambda stand_ins, launch: (lambda stream, args: launched.append(len(args)))
    backend._forced = True  # CPU tensors take the Triton path; launches are stubbed
    B, N = shape
    q = torch.randn(B, 16, 128, dtype=torch.float16)
    k = torch.empty(B, N, 2, 128, dtype=torch.float16)
    v = torch.empty_like(k)
    lens = torch.full((B,), N, dtype=torch.int32)

    def call():
        return longctx.decode(q, k, v, cache_seqlens=lens)
    call()
    plan = next(iter(api._PLANS.values()))
    scratch = torch.empty(plan.scratch)
    o = torch.empty_like(q)
    counters = L.stream_counters(max(plan.counters, 1), 0)
    dyn_split = (q.data_ptr(), k.data_ptr(), v.data_ptr(), lens.data_ptr(), lens.data_ptr(),
                 scratch.data_ptr(), scratch.data_ptr() + 4 * plan.lse_part_off, o.data_ptr(),
                 scratch.data_ptr() + 4 * plan.lse_off, counters.data_ptr())
    launches = "one launch" if plan.merge is None else "two launches"

    def us(f):
        return min(timeit.repeat(f, number=n, repeat=5)) / n * 1e6

    def lookup():  # longctx.decode's key for this call
        return api._PLANS.get((0, q.get_device(), q.dtype, q.shape, q.stride(), k.get_device(),
                               k.dtype, k.shape, k.stride(), v.get_device(), v.dtype, v.shape,
                               v.stride(), L.signature(lens), L.signature(None), None, None,
                               False, pdl_allowed()))
    assert lookup() is plan
    parts = {
        "fast_launch_active + current_device": us(
            lambda: (L.fast_launch_active(), L.current_device())),
        "cache key (devices, dtypes, shapes, strides, PDL flag) + dict lookup": us(lookup),
        "output allocation (CPU torch.empty_like)": us(
            lambda: torch.empty_like(q, memory_format=torch.contiguous_format)),
        "stream scratch (partials)": us(lambda: L.stream_scratch(4 * plan.scratch, 0, "decode")),
        "stream counters (fused merge)": us(lambda: L.stream_counters(max(plan.counters, 1), 0)),
        "data pointers (6) + dynamic-argument tuple": us(
            lambda: (q.data_ptr(), k.data_ptr(), v.data_ptr(), lens.data_ptr(), scratch.data_ptr(),
                     o.data_ptr())),
        "Launch.__call__ (spec_code, binary lookup, argument tuple), launcher stubbed": us(
            lambda: plan.split(dyn_split, 0)),
        f"whole longctx.decode call ({launches}, stubbed)": us(call),
    }
    qa = torch.randn(1, 512, 16, 128, dtype=torch.bfloat16)
    ka = torch.randn(1, 512, 2, 128, dtype=torch.bfloat16)
    o_p, lse_p = torch.randn(8, 4, 16, 128), torch.randn(8, 4, 16)
    acc = (torch.zeros(4, 16, 128), torch.full((4, 16), float("-inf")))
    for name, f in (("whole longctx.attention call (1x512 causal, stubbed)",
                     lambda: longctx.attention(qa, ka, ka, causal=True)),
                    ("whole longctx.attention_merge_into call (1x512 causal, stubbed)",
                     lambda: longctx.attention_merge_into(torch.empty(1, 512, 16, 128),
                                                          torch.empty(1, 512, 16), qa, ka, ka,
                                                          causal=True)),
                    ("whole longctx.merge_states call (8 parts, stubbed, check=False)",
                     lambda: longctx.merge_states(o_p, lse_p, check=False)),
                    ("whole longctx.merge_into call (stubbed, check=False)",
                     lambda: longctx.merge_into(*acc, o_p[0], lse_p[0], check=False))):
        f()
        parts[name] = us(f)
    print(f"CPU, launches stubbed, decode {B}x{N} (num_splits {plan.num_splits}), µs per call:")
    for name, t in parts.items():
        print(f"  {t:6.2f}  {name}")
    return parts


# ------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", nargs="*", default=None,
                    help="BxN shapes (default: configs/bench.yaml's decode shapes)")
    ap.add_argument("--prefill", nargs="*", type=int, default=[512, 2048, 8192],
                    help="query = key rows of the causal prefill shapes")
    ap.add_argument("--calls", type=int, default=200, help="calls per repetition (decode)")
    ap.add_argument("--tag", default="", help="appended to the JSON file name")
    ap.add_argument("--stub", action="store_true", help="CPU only: the fast path's Python side")
    args = ap.parse_args()
    if args.stub:
        result = {"stub_breakdown_us": stub_breakdown((1, 65536))}
        out_dir = Path(os.environ.get("OUT") or ROOT / "bench" / "results" / "raw")
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"host-time-stub{'-' + args.tag if args.tag else ''}.json").write_text(
            json.dumps(result, indent=1))
        return
    if not torch.cuda.is_available():
        sys.exit("bench/host_time.py needs a CUDA GPU (or --stub for the CPU breakdown)")
    import triton

    from longctx.hardware import code_commit

    shapes = ([tuple(int(x) for x in s.split("x")) for s in args.decode] if args.decode is not None
              else [tuple(s) for s in _decode_config()["shapes"]])
    cpm = _cycles_per_ms()
    device = torch.cuda.get_device_name()
    rows = run_decode(shapes, args.calls, cpm) + run_prefill(args.prefill, max(20, args.calls // 4), cpm)
    for r in rows:
        r["targets"] = targets(r)
    result = {"device": device, "commit": code_commit(), "torch": torch.__version__,
              "triton": triton.__version__, "date": datetime.now(timezone.utc).isoformat(),
              "calls": args.calls, "rows": rows}
    out_dir = Path(os.environ.get("OUT") or ROOT / "bench" / "results" / "raw")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"host-time{'-' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {path}")
    print_table(rows, device)


if __name__ == "__main__":
    main()
