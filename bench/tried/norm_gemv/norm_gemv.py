"""Prototype v2: push all-reduce's sum + residual add + RMSNorm fused into the next GEMV.

LOCAL: one K-element buffer (int view) that holds marks (-0.0) at every call's start. The first
program to take a ticket (taken before the PDL wait) does the reduction as _push_all_reduce_kernel
and stores the normed row into LOCAL (-0.0 sent as +0.0); every program takes x chunk by chunk from
LOCAL with volatile loads, spinning while a mark is left. The last program to finish clears LOCAL,
resets the ticket and advances the call count.
FLAGS: [0] count, [1] elements of the last call, [2] finished programs, [3] tickets.
"""
import torch
import triton
import triton.language as tl

from longctx.kernels.allreduce import PushBuffers, push_constexprs
from longctx.kernels.gemv import _load_w, gemv_config
from longctx.kernels.utils import cdiv, next_power_of_2, pdl_launch


@triton.jit
def _nanosleep(ptr):
    tl.inline_asm_elementwise("nanosleep.u32 100; mov.u32 $0, 0;", "=r,l", [ptr],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _ld_acquire(ptr):
    return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _take_x(ptrs, mask, MARK: tl.constexpr, SLEEP: tl.constexpr):
    v = tl.load(ptrs, mask=mask, other=0, volatile=True)
    while tl.max((v == MARK).to(tl.int32), axis=0) > 0:
        if SLEEP:
            _nanosleep(ptrs)
        v = tl.load(ptrs, mask=mask, other=0, volatile=True)
    return v


@triton.jit
def _norm_gemv_kernel(W, Y, R, S, NW, N, K, stride_wn, BUF, LOCAL, FLAGS, READY, rank, slot, eps,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      GATED: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
                      IDT: tl.constexpr, MARK: tl.constexpr, USE_PDL: tl.constexpr,
                      SLEEP: tl.constexpr, FLAG: tl.constexpr, PID0: tl.constexpr = False, CHECK: tl.constexpr = 0):
    if GATED:
        n_out = N // 2
        j = tl.arange(0, BLOCK_N)
        offs_o = tl.program_id(0) * (BLOCK_N // 2) + j // 2
        rows = tl.minimum(offs_o, n_out - 1) + (j % 2) * n_out
    else:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_n, N - 1)
    rows = rows.to(tl.int64) * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    w = _load_w(W, rows, offs_k, K, EVEN_K)
    # The previous call's last program reset the tickets before this kernel could start.
    if PID0:
        ticket = tl.program_id(0)
    else:
        ticket = tl.atomic_add(FLAGS + 3, 1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if (ticket == 0) & (CHECK < 3):
        count = tl.load(FLAGS, volatile=True)
        prev = tl.load(FLAGS + 1, volatile=True)
        rnd = count % 3
        old = (rnd + 2) % 3
        for src in tl.static_range(WORLD):
            base = BUF + (old * WORLD + src).to(tl.int64) * slot
            for start in range(0, prev, BLOCK_K):
                tl.store(base + start + offs_k, MARK, mask=start + offs_k < prev)
        srcs = tl.arange(0, WORLD_P2)
        ssq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            km = ks < K
            ptrs = BUF + (rnd * WORLD + srcs)[:, None].to(tl.int64) * slot + ks[None, :]
            m2 = (srcs < WORLD)[:, None] & km[None, :]
            v = tl.load(ptrs, mask=m2, other=0, volatile=True)
            while tl.max(tl.max((v == MARK).to(tl.int32), axis=1), axis=0) > 0:
                v = tl.load(ptrs, mask=m2, other=0, volatile=True)
            v = v.to(Y.dtype.element_ty, bitcast=True).to(tl.float32)
            acc = tl.zeros([BLOCK_K], dtype=tl.float32)
            for src in tl.static_range(WORLD):
                acc += tl.sum(tl.where((srcs == src)[:, None], v, 0.0), axis=0)
            total = acc.to(Y.dtype.element_ty)
            r = tl.load(R + ks, mask=km, other=0.0)
            h = (r.to(tl.float32) + total.to(tl.float32)).to(Y.dtype.element_ty)
            tl.store(S + ks, h, mask=km)
            hf = h.to(tl.float32)
            ssq += hf * hf
        inv = tl.rsqrt(tl.sum(ssq, axis=0) / K + eps)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            km = ks < K
            hf = tl.load(S + ks, mask=km, other=0.0).to(tl.float32)
            nw = tl.load(NW + ks, mask=km, other=0.0).to(tl.float32)
            y = (nw * (hf * inv).to(Y.dtype.element_ty).to(tl.float32)).to(Y.dtype.element_ty)
            bits = y.to(IDT, bitcast=True)
            bits = tl.where(bits == MARK, tl.zeros_like(bits), bits)
            tl.store(LOCAL + ks, bits, mask=km)
        if PID0:
            # Every other program waits for this one: none reads the count.
            tl.store(FLAGS + 1, K)
            tl.store(FLAGS, count + 1)
    if FLAG:
        if ticket == 0:
            tl.debug_barrier()
            tl.atomic_xchg(READY, 1, sem="release", scope="gpu")
        if CHECK == 0:
            while _ld_acquire(READY) == 0:
                if SLEEP:
                    _nanosleep(READY)
        elif CHECK == 1:
            while tl.load(READY, volatile=True) == 0:
                pass
        else:
            if tl.program_id(0) < 1056:
                while _ld_acquire(READY) == 0:
                    pass
        if CHECK == 4:
            x = tl.load(LOCAL + offs_k, mask=offs_k < K, other=0)
        else:
            x = tl.load(LOCAL + offs_k, mask=offs_k < K, other=0, cache_modifier=".cg")
    else:
        x = _take_x(LOCAL + offs_k, offs_k < K, MARK, SLEEP)
    acc = w.to(tl.float32) * x.to(Y.dtype.element_ty, bitcast=True).to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + offs_k
        w = _load_w(W, rows, ks, K, EVEN_K)
        if FLAG and CHECK == 4:
            x = tl.load(LOCAL + ks, mask=ks < K, other=0)
        elif FLAG:
            x = tl.load(LOCAL + ks, mask=ks < K, other=0, cache_modifier=".cg")
        else:
            x = _take_x(LOCAL + ks, ks < K, MARK, SLEEP)
        acc += w.to(tl.float32) * x.to(Y.dtype.element_ty, bitcast=True).to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1).to(Y.dtype.element_ty)
    if GATED:
        g, u = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        g = g.to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
        offs_o = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(Y + offs_o, (a * u.to(tl.float32)).to(Y.dtype.element_ty), mask=offs_o < n_out)
    else:
        tl.store(Y + offs_n, y, mask=offs_n < N)
    # The last program to finish: every program has read LOCAL (clear it) and the count.
    if PID0:
        pass  # the pushing GEMV before the next call resets READY
    elif tl.atomic_add(FLAGS + 2, 1) == tl.num_programs(0) - 1:
        if FLAG:
            tl.store(READY, 0)
        else:
            for k0 in range(0, K, BLOCK_K):
                tl.store(LOCAL + k0 + offs_k, MARK, mask=k0 + offs_k < K)
        count = tl.load(FLAGS, volatile=True)
        tl.store(FLAGS + 3, 0)
        tl.store(FLAGS + 2, 0)
        tl.store(FLAGS + 1, K)
        tl.store(FLAGS, count + 1)


def norm_gemv(residual, weight, norm_weight, eps, bufs: PushBuffers, local, gated=False,
              config=None, sleep=False, flag=False, ready=None, pid0=False, check=0):
    N, K = weight.shape
    out = torch.empty(1, N // 2 if gated else N, dtype=residual.dtype, device=residual.device)
    s = torch.empty_like(residual)
    block_n, block_k, warps = config or gemv_config(K)
    world = bufs.peers.numel()
    _norm_gemv_kernel[(cdiv(N, block_n),)](
        weight, out, residual, s, norm_weight, N, K, weight.stride(0), bufs.buf, local,
        bufs.flags, bufs.flags[3:] if pid0 else (ready if flag else bufs.flags), bufs.rank, bufs.slot, eps, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=K % block_k == 0, GATED=gated, WORLD_P2=next_power_of_2(world), SLEEP=sleep, FLAG=flag, PID0=pid0, CHECK=check,
        **push_constexprs(residual.dtype, world), num_warps=warps, **pdl_launch(residual.device))
    return s, out
