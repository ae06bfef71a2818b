"""Benchmarks against the physical floor and the field's kernels, measured in the same run.

    python launch/bench.py case=decode            # Flash-Decoding table (fp16, 16/2 heads, D=128)
    python launch/bench.py case=prefill           # prefill TFLOPS (bf16, D=128)
    python launch/bench.py case=prefill prefill_table=any_length  # odd lengths, 3 head
                                                  # layouts, D=64/256, varlen
    python launch/bench.py case=prefill prefill_table=head_dims # D=96/192/128/256 rows
    python launch/bench.py case=decode decode_table=head_dims   # D=96/192/128 rows
    python launch/bench.py case=decode decode_table=fp8  # fp8 KV cache vs bf16 longctx, vLLM fp8
    python launch/bench.py case=decode decode.shapes='[[1,65536]]' tag=h100

Needs a CUDA GPU. Every number is a median of `bench_ms` (each repetition starts with a cold,
clean L2); a prefill row's implementations take turns over `prefill.rounds` rounds
(`interleaved_ms`), the median round reported. Writes <output_dir>/<case>[-tag].json and .png;
prints a table.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import hydra
import torch
import triton
from omegaconf import DictConfig, OmegaConf

import longctx
from longctx.config import DTYPES
from longctx.hardware import code_commit
from longctx.kernels.bandwidth import _read_kernel, read_bandwidth
from longctx.kernels.utils import FP_FUSION

ROOT = Path(__file__).resolve().parents[1]


_FLUSH: list[torch.Tensor] = []


def bench_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median ms of fn over repetitions (about rep_ms of them after warmup_ms of warm-up), each
    starting with a cold L2.

    Like triton.testing.do_bench, but the L2 is flushed by *reading* a buffer larger than it,
    not by a memset: a memset leaves the L2 full of dirty lines, and writing them back to HBM
    lands inside the next timed region (~13 µs on an H200, a large share of a decode step).
    """
    if not _FLUSH:
        _FLUSH.append(torch.ones(128 << 20, dtype=torch.float32, device="cuda"))  # 512 MiB
    flush = _FLUSH[0]

    def one() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        flush.sum()  # read-only: leaves only clean lines in the L2
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        return start, end

    fn()
    torch.cuda.synchronize()
    s, e = one()
    torch.cuda.synchronize()
    est = max(s.elapsed_time(e), 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        one()
    events = [one() for _ in range(max(5, min(2000, int(rep_ms / est))))]
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    return times[len(times) // 2]


def capture_graph(fn: Callable[[], object], calls: int = 1) -> torch.cuda.CUDAGraph:
    """`calls` calls of fn captured in one CUDA graph, after 3 warm-up calls on a side stream
    (compiles and caching-allocator blocks happen outside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def graph_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median ms of `fn` replayed from a CUDA graph (launch overhead removed); see bench_ms."""
    return bench_ms(capture_graph(fn).replay, warmup_ms, rep_ms)


def stream_read_ms(tensors: list[torch.Tensor], warmup_ms: float = 25,
                   rep_ms: float = 100) -> tuple[float, float]:
    """(graph_ms of a pure streaming read of the tensors' bytes, graph_ms of an empty launch of
    the same kernel): what a kernel reading those bytes once can reach under this timing, its
    launch latency and ramp included. Copies the bytes into one buffer first."""
    kv = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]).view(torch.float16)
    grid = triton.cdiv(kv.numel(), 4096 * 4)
    part = torch.empty(grid, device=kv.device, dtype=torch.float32)
    t_read = graph_ms(lambda: _read_kernel[(grid,)](kv, part, kv.numel(), BLOCK=4096, ITERS=4,
                                                    num_warps=8, **FP_FUSION), warmup_ms, rep_ms)
    t_empty = graph_ms(lambda: _read_kernel[(1,)](kv, part, 0, BLOCK=4096, ITERS=1, num_warps=8,
                                                  **FP_FUSION), warmup_ms, rep_ms)
    return t_read, t_empty


def check_peer(make: Callable[[], Callable[[], object]],
               refs: list[torch.Tensor]) -> tuple[Callable[[], object] | None, str]:
    """A peer's function after checking its output(s) against refs (one tensor, or one per
    sequence for a per-sequence peer returning a list): (fn, "") or (None, reason) where the
    peer cannot run the shape or is wrong."""
    try:
        fn = make()
        out = fn()
        outs = out if isinstance(out, list) else [out]
        err = max((o.float() - r).abs().max().item() for o, r in zip(outs, refs))
        if not err < 5e-2:
            return None, f"wrong result (max err {err:.2e})"
        return fn, ""
    except Exception as e:  # a peer that does not support the shape is reported, not fatal
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def try_peer(name: str, make: Callable[[], Callable[[], torch.Tensor]], ref: torch.Tensor,
             cfg: DictConfig, graph: bool = False) -> tuple[float | None, float | None, str]:
    """Time a peer after checking its output: (eager ms, CUDA-graph ms or None, note).
    A peer that cannot run this shape gives (None, None, reason)."""
    fn, why = check_peer(make, [ref])
    if fn is None:
        return None, None, why
    try:
        eager = bench_ms(fn, cfg.warmup_ms, cfg.rep_ms)
    except Exception as e:
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    if not graph:
        return eager, None, ""
    try:
        return eager, graph_ms(fn, cfg.warmup_ms, cfg.rep_ms), ""
    except Exception as e:
        torch.cuda.synchronize()
        return eager, None, f"no CUDA graph: {type(e).__name__}"


def interleaved_ms(fns: dict[str, Callable[[], object]], rounds: int, warmup_ms: float = 25,
                   rep_ms: float = 100) -> dict[str, list[float]]:
    """bench_ms of every function, `rounds` times, the functions taking turns within each round:
    per name the rounds' ms, sorted. A slow or fast spell of the GPU's clocks then meets every
    function of a row alike (an H200's dense 8 x 8192 causal row measured 590-673 TFLOPS across
    runs, 642 then 595 on back-to-back measurements; bench/results/prefill-d64-variants-h200.txt)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench_ms(fn, warmup_ms, rep_ms))
    return {name: sorted(t) for name, t in times.items()}


def interleaved_median_us(fns: dict[str, Callable[[], object]], rounds: int,
                          warmup_ms: float = 10, rep_ms: float = 50) -> dict[str, float]:
    """interleaved_ms's median round of every function, in µs."""
    times = interleaved_ms(fns, rounds, warmup_ms, rep_ms)
    return {name: t[len(t) // 2] * 1e3 for name, t in times.items()}


# ---------------------------------------------------------------- decode
def decode_peers(q, k_t, v_t):
    """Peers on their preferred layout: q [B, Hq, 1, D], k_t/v_t [B, Hkv, N, D] contiguous."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    B, Hq, _, D = q.shape
    Hkv = k_t.shape[1]
    g = Hq // Hkv

    def eager():
        # GQA without repeating KV: [B, Hkv, g, D] @ [B, Hkv, D, N]
        qg = q.view(B, Hkv, g, D)
        s = torch.matmul(qg, k_t.transpose(-1, -2)).float() * D**-0.5
        p = torch.softmax(s, dim=-1).to(q.dtype)
        return torch.matmul(p, v_t).view(B, Hq, 1, D)

    def sdpa(backend):
        def make():
            def fn():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k_t, v_t, enable_gqa=True)
            return fn
        return make

    def flex():
        from torch.nn.attention.flex_attention import flex_attention
        compiled = torch.compile(flex_attention, dynamic=False)
        return lambda: compiled(q, k_t, v_t, enable_gqa=True)

    return {
        "eager": lambda: eager,
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "flex": flex,
    }


def decode_plan(c: DictConfig) -> list[tuple[int, int, int]]:
    """(head_dim, batch, kv length) of every decode row at (q_heads, kv_heads): `shapes` at
    head_dim, then the extra_head_dims rows."""
    plan = [(c.head_dim, B, N) for B, N in c.shapes]
    for d, shapes in (c.get("extra_head_dims") or {}).items():
        plan += [(int(d), B, N) for B, N in shapes]
    return plan


def decode_rows(c: DictConfig) -> list[tuple[int, int, int, int, int]]:
    """(q heads, kv heads, head_dim, batch, kv length) of every decode row: decode_plan's at
    (q_heads, kv_heads), then each extra_heads entry [q heads, kv heads, [[batch, length], ...]]
    at head_dim."""
    rows = [(c.q_heads, c.kv_heads, d, B, N) for d, B, N in decode_plan(c)]
    for hq, hkv, shapes in c.get("extra_heads") or []:
        rows += [(int(hq), int(hkv), c.head_dim, B, N) for B, N in shapes]
    return rows


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp32 decode attention: q [B, Hq, D], k/v [B, N, Hkv, D] (any float dtype) -> [B, Hq, D]."""
    return torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None].float(), k.float().transpose(1, 2), v.float().transpose(1, 2),
        enable_gqa=True)[:, :, 0]


VLLM_PEER = ROOT / ".peers" / "vllm_triton_decode_attention.py"


def load_vllm_peer():
    """vLLM's Triton decode-attention module from VLLM_PEER (bench/fetch_vllm_peer.sh takes it
    from the vllm wheel), its imports of vLLM stubbed where vLLM is not installed: the platform
    (CUDA, not ROCm) and vllm.triton_utils (Triton itself). FileNotFoundError without the file."""
    import importlib.util
    import types

    if not VLLM_PEER.exists():
        raise FileNotFoundError(f"{VLLM_PEER} missing: run bash "
                                "bench/fetch_vllm_peer.sh where pip reaches PyPI, carry .peers/")
    saved = {n: sys.modules.get(n) for n in ("vllm", "vllm.platforms", "vllm.triton_utils")}
    try:
        import vllm.platforms  # noqa: F401  (the real one, where installed)
    except ImportError:
        platforms = types.ModuleType("vllm.platforms")
        platforms.current_platform = types.SimpleNamespace(is_rocm=lambda: False)
        utils = types.ModuleType("vllm.triton_utils")
        utils.tl, utils.triton = triton.language, triton
        sys.modules.update({"vllm": types.ModuleType("vllm"), "vllm.platforms": platforms,
                            "vllm.triton_utils": utils})
    try:
        spec = importlib.util.spec_from_file_location("vllm_triton_decode_attention", VLLM_PEER)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        for name, m in saved.items():
            if m is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = m
    return mod


def vllm_fp8_peer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  page_size: int = 16) -> tuple[Callable[[], Callable[[], torch.Tensor]], torch.Tensor]:
    """vLLM's Triton decode kernel over an fp8 cache with its per-tensor scales (vLLM's fp8 KV
    format): (make, its fp32 reference on the same dequantized values). The cache is k/v
    [B, N, Hkv, D] quantized, in pages of page_size slots, sequence b's pages in order; the
    split count is the best of 4-64 for the shape (timed, CUDA-graph replay)."""
    from longctx.fp8 import quantize_fp8

    B, N, Hkv, D = k.shape
    Hq = q.shape[1]
    (kq, ks), (vq, vs) = (quantize_fp8(t, t.abs().amax().float()) for t in (k, v))
    ref = attention_ref(q, kq.float() * ks, vq.float() * vs)
    pages = -(-N // page_size)

    def make():
        mod = load_vllm_peer()
        kb = kq.view(B * N // page_size, page_size, Hkv, D)
        vb = vq.view(B * N // page_size, page_size, Hkv, D)
        table = torch.arange(B * pages, device=q.device, dtype=torch.int32).view(B, pages)
        lens = torch.full((B,), N, device=q.device, dtype=torch.int32)
        o = torch.empty_like(q)
        lse = torch.empty(B, Hq, device=q.device, dtype=torch.float32)

        def with_splits(n: int) -> Callable[[], torch.Tensor]:
            logits = torch.empty(B, Hq, n, D + 1, device=q.device, dtype=torch.float32)

            def fn():
                mod.decode_attention_fwd(q, kb, vb, o, lse, table, lens, logits, n, D**-0.5,
                                         page_size, 0.0, ks, vs)
                return o
            return fn

        best = min((graph_ms(with_splits(n), 5, 20), n) for n in (4, 8, 16, 32, 64))
        return with_splits(best[1])
    return make, ref


def run_decode(cfg: DictConfig) -> dict:
    c = cfg.decode
    dtype = DTYPES[c.dtype]
    fp8 = c.get("kv_cache_dtype", "auto") == "fp8_e4m3"
    bw = read_bandwidth()
    print(f"HBM read bandwidth (streaming read kernel, 4 GiB): {bw / 1e12:.2f} TB/s")
    if c.get("page_size"):
        print(f"longctx's caches paged, pages of {c.page_size}")
    rows = []
    for Hq, Hkv, D, B, N in decode_rows(c):
        q = torch.randn(B, Hq, D, device="cuda", dtype=dtype)
        k = torch.randn(B, N, Hkv, D, device="cuda", dtype=dtype)
        v = torch.randn(B, N, Hkv, D, device="cuda", dtype=dtype)
        seqlens = torch.full((B,), N, device="cuda", dtype=torch.int32)
        kv_bytes = 2 * k.numel() * k.element_size()
        ref = half_ref = attention_ref(q, k, v)  # fp32, over the cache in the table's dtype
        # page_size: longctx reads every cache paged, sequence b's pages in order (as vLLM's
        # peer does); the pages [B * N / page_size, page_size, Hkv, D].
        ps = c.get("page_size") or None
        table = None if ps is None else torch.arange(
            B * N // ps, device="cuda", dtype=torch.int32).view(B, N // ps)

        def paged(t: torch.Tensor) -> torch.Tensor:
            return t if ps is None else t.view(B * N // ps, ps, *t.shape[2:])
        if fp8:
            # longctx's fp8 cache: e4m3 K/V and a float32 scale per (token, KV head), counted in
            # the floor, in the model's layout (K and the scales head-major, V key-major; within
            # each page when paged); its reference attends to the same dequantized values.
            from longctx.fp8 import dequantize_kv, model_layout, quantize_kv

            (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
            kv_bytes = 2 * (kq.numel() + 4 * ks.numel())
            ref = attention_ref(q, dequantize_kv(kq, ks), dequantize_kv(vq, vs))
            kq, vq, ks, vs = model_layout(*map(paged, (kq, vq, ks, vs)), paged=ps is not None)

            def ours():
                return longctx.decode(q, kq, vq, cache_seqlens=seqlens, num_splits=c.num_splits,
                                      k_scale=ks, v_scale=vs, block_table=table)
        else:
            def ours():
                return longctx.decode(q, paged(k), paged(v), cache_seqlens=seqlens,
                                      num_splits=c.num_splits, block_table=table)
        floor_us = kv_bytes / bw * 1e6
        err = (ours().float() - ref).abs().max().item()
        row = {"q_heads": Hq, "kv_heads": Hkv, "head_dim": D, "batch": B, "seq_len": N,
               "kv_cache_dtype": "fp8_e4m3" if fp8 else c.dtype, "page_size": ps,
               "kv_bytes": kv_bytes,
               "floor_us": floor_us,
               "longctx_us": bench_ms(ours, cfg.warmup_ms, cfg.rep_ms) * 1e3, "longctx_max_err": err}
        if c.cuda_graph:
            row["longctx_graph_us"] = graph_ms(ours, cfg.warmup_ms, cfg.rep_ms) * 1e3
        k_t, v_t = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        # Each peer with the fp32 reference of what it reads: the sdpa peers [B, Hq, 1, D] and
        # longctx_bf16 (longctx on the cache in the table's dtype) the unquantized cache.
        peers = {n: (make, half_ref[:, :, None])
                 for n, make in decode_peers(q[:, :, None], k_t, v_t).items()}
        peers["longctx_bf16"] = (lambda: lambda: longctx.decode(
            q, paged(k), paged(v), cache_seqlens=seqlens, num_splits=c.num_splits,
            block_table=table), half_ref)
        if "vllm_fp8" in c.peers:
            peers["vllm_fp8"] = vllm_fp8_peer(q, k, v, ps or 16)
        for name in c.peers:
            ms, gms, why = try_peer(name, *peers[name], cfg, graph=c.cuda_graph)
            row[f"{name}_us"] = None if ms is None else ms * 1e3
            row[f"{name}_graph_us"] = None if gms is None else gms * 1e3
            if why:
                row[f"{name}_note"] = why
        rows.append(row)
        del q, k, v, k_t, v_t, peers
        torch.cuda.empty_cache()
        print_row_decode(row, c.peers, header=len(rows) == 1)
        for name in c.peers:  # a peer that could not run, and why (e.g. vLLM's file missing)
            if row.get(f"{name}_note") and len(rows) == 1:
                print(f"  {name}: {row[f'{name}_note']}")
    return {"read_bandwidth_Bps": bw, "rows": rows}


def best_us(r: dict, name: str) -> float | None:
    """The faster of eager and CUDA-graph timing (launch overhead excluded where capturable)."""
    ts = [t for t in (r.get(f"{name}_us"), r.get(f"{name}_graph_us")) if t]
    return min(ts) if ts else None


def print_row_decode(r: dict, peers, header: bool) -> None:
    if header:
        print("(µs, each the faster of eager and CUDA-graph replay; %floor and speedup use longctx's)")
        print(f"{'heads':>5} {'D':>3} {'B':>4} {'N':>7} {'floor':>7} {'eager':>8} {'graph':>7} "
              f"{'%floor':>6} "
              + " ".join(f"{p:>10}" for p in peers) + f" {'vs best':>7} {'err':>8}")
    best_t = [best_us(r, p) for p in peers if best_us(r, p)]
    t = best_us(r, "longctx")
    best = min(best_t) if best_t else math.nan
    peers_s = " ".join(f"{best_us(r, p):>10.1f}" if best_us(r, p) else f"{'n/a':>10}"
                       for p in peers)
    heads = f"{r.get('q_heads', '')}/{r.get('kv_heads', '')}"
    print(f"{heads:>5} {r.get('head_dim', 128):>3} {r['batch']:>4} {r['seq_len']:>7} "
          f"{r['floor_us']:>7.1f} "
          f"{r['longctx_us']:>8.1f} "
          f"{r.get('longctx_graph_us', math.nan):>7.1f} {100 * r['floor_us'] / t:>5.0f}% "
          f"{peers_s} {best / t:>6.2f}x {r['longctx_max_err']:>8.1e}")


# ---------------------------------------------------------------- prefill
def varlen_lengths(total: int, num_seqs: int, seed: int) -> list[int]:
    """num_seqs random sequence lengths summing to total (each >= 1; uniform weights from a
    seeded generator, so every run and every script draws the same batch)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(num_seqs, generator=g, dtype=torch.float64) + 0.05
    lens = [max(1, int(x)) for x in (w / w.sum() * total).tolist()]
    lens[int(torch.tensor(lens).argmax())] += total - sum(lens)
    return lens


def prefill_flops(lens: list[int], hq: int, d: int, causal: bool) -> float:
    """4 * Hq * S^2 * D per sequence (Q K^T and P V), halved for causal."""
    return sum(4.0 * hq * n * n * d * (0.5 if causal else 1.0) for n in lens)


def with_prefill_kernel(fn: Callable[[], object], choice: str) -> Callable[[], object]:
    """fn run inside `prefill_kernel(choice)` ("triton": the Triton kernel on every GPU)."""
    from longctx.kernels.prefill import prefill_kernel

    def run():
        with prefill_kernel(choice):
            return fn()
    return run


def _peer_backends() -> dict:
    from torch.nn.attention import SDPBackend

    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def sdpa_fn(backend, qt, kt, vt, causal: bool) -> Callable[[], torch.Tensor]:
    """SDPA on one backend, inputs [B, H, S, D]."""
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F

    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
    return fn


def prefill_row(cfg: DictConfig, hq: int, hkv: int, d: int, lens: list[int], causal: bool,
                varlen: bool) -> dict:
    """One table row. Dense: B = len(lens) sequences of lens[0] rows ([B, S, H, D] tensors).
    Varlen: the sequences packed ([T, H, D] with cu_seqlens); the peers (SDPA has no varlen)
    run one call per sequence inside one timed function, and "dense same tokens" is longctx on
    a dense batch of the same sequence count and total tokens (B x T / B)."""
    backends = _peer_backends()
    c = cfg.prefill
    dtype = DTYPES[c.dtype]
    total = sum(lens)
    if varlen:
        q = torch.randn(total, hq, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(total, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32,
                          device="cuda")
        seqs = [(q[a:e], k[a:e], v[a:e]) for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())]

        def ours():
            return longctx.attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    else:
        b, n = len(lens), lens[0]
        q = torch.randn(b, n, hq, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, n, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
        seqs = [(q, k, v)]

        def ours():
            return longctx.attention(q, k, v, causal=causal)
    # peers on their preferred layout: [B, H, S, D] contiguous, per sequence when varlen
    tr = [tuple(x.unsqueeze(0).transpose(1, 2).contiguous() if varlen
                else x.transpose(1, 2).contiguous() for x in s) for s in seqs]

    def per_seq(backend):
        fns = [sdpa_fn(backend, *t, causal) for t in tr]
        return lambda: [f() for f in fns]

    # SDPA flash's output (fp32 copy) as the reference, in longctx's layout (varlen: packed)
    refs = [o.float() for o in per_seq(backends["sdpa_flash"])()]
    ref = (torch.cat([r[0].transpose(0, 1) for r in refs]) if varlen
           else refs[0].transpose(1, 2))
    err = (ours().float() - ref).abs().max().item()
    row = {"kind": "varlen" if varlen else "dense", "q_heads": hq, "kv_heads": hkv,
           "head_dim": d, "batch": len(lens), "seq_len": total if varlen else lens[0],
           "causal": causal, "flops": prefill_flops(lens, hq, d, causal), "longctx_max_err": err}
    if varlen:
        row["lengths"] = lens
    fns: dict[str, Callable[[], object]] = {"longctx": ours}
    if c.compare_triton:  # the Triton kernel on the same call (the Gluon kernel's A/B)
        fns["triton"] = with_prefill_kernel(ours, "triton")
    for name in c.peers:
        if varlen and name == "flex":
            fn, why = None, "not run for varlen"
        elif varlen:
            fn, why = check_peer(lambda: per_seq(backends[name]), refs)
        elif name == "flex":
            fn, why = check_peer(lambda: flex_fn(tr[0], causal), refs)
        else:
            fn, why = check_peer(lambda: sdpa_fn(backends[name], *tr[0], causal), refs)
        if fn is None:
            row[f"{name}_ms"], row[f"{name}_note"] = None, why
        else:
            fns[name] = fn
    if varlen:  # longctx on a dense batch of the same sequence count and total tokens
        n = total // len(lens)
        qd = torch.randn(len(lens), n, hq, d, device="cuda", dtype=dtype)
        kd, vd = (torch.randn(len(lens), n, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
        fns["dense_same_tokens"] = lambda: longctx.attention(qd, kd, vd, causal=causal)
        row["dense_same_tokens_flops"] = prefill_flops([n] * len(lens), hq, d, causal)
    # every implementation of the row in each round; the median round reported, all kept
    for name, ms in interleaved_ms(fns, c.rounds, cfg.warmup_ms, cfg.rep_ms).items():
        row[f"{name}_ms"], row[f"{name}_rounds_ms"] = statistics.median(ms), ms
    return row


def flex_fn(t: tuple[torch.Tensor, ...], causal: bool) -> Callable[[], torch.Tensor]:
    """FlexAttention (compiled) on [B, H, S, D] tensors."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    qt, kt, vt = t
    n = qt.shape[2]
    compiled = torch.compile(flex_attention, dynamic=False)
    mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, n, n) if causal else None
    return lambda: compiled(qt, kt, vt, block_mask=mask, enable_gqa=True)


def prefill_plan(c: DictConfig) -> list[tuple[int, int, int, list[int], bool, bool]]:
    """(q heads, kv heads, head_dim, lengths, causal, varlen) of every prefill row: the dense
    table (heads x seq_lens x causal at head_dim, then the extra_head_dims rows) and the varlen
    rows (c.varlen: num_seqs random lengths summing to total)."""
    plan = [(hq, hkv, c.head_dim, [n] * c.batch, causal, False)
            for hq, hkv in c.heads for n in c.seq_lens for causal in c.causal]
    for d, lens in (c.get("extra_head_dims") or {}).items():
        plan += [(hq, hkv, int(d), [n] * c.batch, causal, False)
                 for hq, hkv in c.heads for n in lens for causal in c.causal]
    if c.get("varlen"):
        lens = varlen_lengths(c.varlen.total, c.varlen.num_seqs, c.varlen.seed)
        plan += [(hq, hkv, c.head_dim, lens, causal, True) for hq, hkv in c.heads
                 for causal in c.causal]
    return plan


def run_prefill(cfg: DictConfig) -> dict:
    """The rows of `prefill_plan`."""
    c = cfg.prefill
    plan = prefill_plan(c)
    if c.get("varlen"):
        lens = plan[-1][3]
        print(f"varlen rows: {len(lens)} sequences {lens} (total {sum(lens)})")
    rows = []
    for hq, hkv, d, lens, causal, varlen in plan:
        rows.append(prefill_row(cfg, hq, hkv, d, lens, causal, varlen))
        torch.cuda.empty_cache()
        print_row_prefill(rows[-1], c.peers, header=len(rows) == 1)
    return {"rows": rows}


def tflops(row: dict, key: str, flops_key: str = "flops") -> float | None:
    ms = row.get(key)
    return None if not ms else row[flops_key] / (ms * 1e-3) / 1e12


def print_row_prefill(r: dict, peers, header: bool) -> None:
    if header:
        print("(TFLOPS, causal FLOPs halved; varlen: the peers run one call per sequence, "
              "'dense' = longctx on B x T/B dense rows of the same tokens; "
              "vs = longctx / best peer)")
        print(f"{'kind':>6} {'D':>3} {'Hq/Hkv':>7} {'N':>6} {'causal':>6} {'longctx':>8} "
              + " ".join(f"{p:>10}" for p in peers) + f" {'triton':>7} {'dense':>7} {'vs':>6}"
              f" {'err':>8}")
    peer_tf = [tflops(r, f"{p}_ms") for p in peers]
    peers_s = " ".join(f"{t:>10.0f}" if t else f"{'n/a':>10}" for t in peer_tf)
    ours = tflops(r, "longctx_ms")
    best = max([t for t in peer_tf if t], default=None)
    tri = tflops(r, "triton_ms")
    dense = (tflops(r, "dense_same_tokens_ms", "dense_same_tokens_flops")
             if "dense_same_tokens_ms" in r else None)
    print(f"{r['kind']:>6} {r['head_dim']:>3} {r['q_heads']:>3}/{r['kv_heads']:<3} "
          f"{r['seq_len']:>6} {str(r['causal']):>6} {ours:>8.0f} {peers_s} "
          f"{tri if tri else float('nan'):>7.0f} {dense if dense else float('nan'):>7.0f} "
          f"{ours / best if best else float('nan'):>5.2f}x {r['longctx_max_err']:>8.1e}")


# ---------------------------------------------------------------- output
def plot(case: str, result: dict, peers, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 5))
    if case == "decode":
        dims = sorted({r.get("head_dim", 128) for r in rows})
        for d in dims:  # one set of lines per head_dim
            rs = [r for r in rows if r.get("head_dim", 128) == d]
            tag = f" D={d}" if len(dims) > 1 else ""
            x = [r["seq_len"] for r in rs]
            ax.plot(x, [r["floor_us"] for r in rs], "k--",
                    label=f"floor (KV bytes / read BW){tag}")
            ax.plot(x, [r["longctx_us"] for r in rs], "o-", label=f"longctx{tag}")
            if "longctx_graph_us" in rs[0]:
                ax.plot(x, [r["longctx_graph_us"] for r in rs], "o-",
                        label=f"longctx (CUDA graph){tag}")
            for p in peers:
                ax.plot(x, [best_us(r, p) or float("nan") for r in rs], ".-", label=f"{p}{tag}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV length N (batch = 65536 / N, min 1)")
        ax.set_ylabel("latency (µs)")
    else:
        labels = [f"{'varlen ' if r.get('kind') == 'varlen' else ''}"
                  f"{'' if r.get('head_dim', 128) == 128 else 'D' + str(r['head_dim']) + ' '}"
                  f"{r['q_heads']}/{r['kv_heads']} {r['seq_len'] / 1024:.0f}k"
                  f"{' c' if r['causal'] else ''}" for r in rows]
        xs = range(len(rows))
        for i, name in enumerate(["longctx", *peers]):
            ax.bar([x + 0.2 * i for x in xs], [tflops(r, f"{name}_ms") or 0 for r in rows],
                   width=0.2, label=name)
        ax.set_xticks([x + 0.3 for x in xs], labels, rotation=45, ha="right")
        ax.set_ylabel("TFLOPS (causal FLOPs halved)")
    ax.set_title(f"{case}: {torch.cuda.get_device_name()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def environment() -> dict:
    commit = code_commit()
    return {"device": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(),
            "commit": commit, "torch": torch.__version__, "triton": triton.__version__,
            "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            # "triton" keeps prefill off the Gluon Hopper kernel (kernels/prefill.py)
            "prefill_kernel": os.environ.get("LONGCTX_PREFILL_KERNEL") or "auto"}


def warm_up_gpu(seconds: float = 1.0) -> None:
    """Keep the GPU busy for `seconds` so that the first timed row does not run on clocks that
    are still ramping up from idle (the first row of an H200 prefill run measured 281 TFLOPS,
    480 in two re-runs a minute later; bench/results/prefill-h200-4096-rerun*.json)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


@hydra.main(config_path="../configs", config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if not torch.cuda.is_available():
        sys.exit("launch/bench.py needs a CUDA GPU")
    # FlexAttention compiles once per shape; the default recompile limit (8) would silently
    # fall back to its unfused eager path for the later shapes.
    torch._dynamo.config.cache_size_limit = 256
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 256
    torch.manual_seed(0)
    env = environment()
    print(f"{env['device']} | torch {env['torch']} | triton {env['triton']} | commit {env['commit']} "
          f"| prefill kernel {env['prefill_kernel']}")
    warm_up_gpu()
    result = run_decode(cfg) if cfg.case == "decode" else run_prefill(cfg)
    case_cfg = cfg[cfg.case]
    out = Path(cfg.output_dir)
    if not out.is_absolute():
        out = ROOT / out
    out.mkdir(parents=True, exist_ok=True)
    stem = cfg.case + (f"-{cfg.tag}" if cfg.tag else "")
    (out / f"{stem}.json").write_text(json.dumps(
        {"env": env, "config": OmegaConf.to_container(case_cfg), **result}, indent=1))
    plot(cfg.case, result, case_cfg.peers, out / f"{stem}.png")
    print(f"wrote {out / stem}.json and .png")


if __name__ == "__main__":
    main()
