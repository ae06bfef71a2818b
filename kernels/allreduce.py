"""Push all-reduce for decode-sized messages over peer-mapped buffers (NVLink, no multicast),
optionally fused with the residual add and RMSNorm that follow a row-parallel projection.

Protocol ("Lamport" one-shot, as TensorRT-LLM's and FlashInfer's custom all-reduces): every rank
owns a buffer of 3 rotating rounds x W slots x `slot` elements, readable and writable by every
peer (torch symmetric memory maps them; `PushBuffers` says where they are). A call with round
b = count % 3 makes each rank store its partial straight into slot `rank` of round b of every
rank's buffer (its own included), after turning -0.0 into +0.0, then spin on its own buffer
until no element of round b holds -0.0, the "not arrived" mark (polling the W slots together),
and sum the W slots in rank order (the same bits on every rank). No barrier: each element announces itself.

Round b must hold only marks when the peers start writing it. Each call clears the round of the
call before (its own buffer, every slot, as many elements as that call used): by then every peer
has written it (this rank has read all of it), and no peer writes it again before this rank's
next call has sent its data (a peer must first finish the call in between, which needs this
rank's data). So three rounds suffice, and nothing but the call count and the previous call's
size needs to be remembered between calls: both live in device memory (FLAGS), so the rotation
survives CUDA-graph replays and any mix of eager and replayed calls.

FLAGS (int32 [4], this rank's own): [0] call count, [1] elements of the previous call, [2]
programs that have read [0] and [1] in the current call (the last of them advances both).

Programmatic dependent launch: once its predecessor has completed, the kernel lets its dependent
(the next GEMV) launch, so that kernel's first weight tiles stream while this one works. After a
GEMV that pushed its output itself, that release comes either once the sum is in (the default)
or, with `early`, as soon as the GEMV has ended, before the wait for the peers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from longctx.kernels.utils import next_power_of_2, pdl_launch

ROUNDS = 3

# The integer type of the same width as each dtype, and -0.0 in it: the "not arrived" mark.
_INT = {torch.bfloat16: (torch.int16, -32768), torch.float16: (torch.int16, -32768),
        torch.float32: (torch.int32, -2147483648)}
_TL_INT = {torch.int16: tl.int16, torch.int32: tl.int32}


def mark_dtype(dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """(the integer dtype a buffer for `dtype` messages is stored as, the mark value: -0.0's
    bits). ValueError for dtypes the protocol does not carry."""
    if dtype not in _INT:
        raise ValueError(f"the push all-reduce carries bfloat16, float16 or float32, got {dtype}")
    return _INT[dtype]


class PushBuffers(NamedTuple):
    """One rank's handle on the buffers of the push protocol.

    buf: this rank's buffer, ROUNDS x W x slot elements of `mark_dtype(dtype)[0]` (int16 for
    16-bit messages, int32 for float32), all holding the mark before the first call; peers:
    int64 [W] on buf's device, where rank r's buffer starts relative to buf, in elements (16-byte
    aligned: multiples of 16 bytes); flags: this rank's int32 [4], zeros before the first call;
    rank: this rank's index in the group; slot: elements per rank and round (>= a message).
    """

    buf: torch.Tensor
    peers: torch.Tensor
    flags: torch.Tensor
    rank: int
    slot: int

    @staticmethod
    def from_addresses(buf: torch.Tensor, addresses: list[int], rank: int,
                       slot: int) -> "PushBuffers":
        """From every rank's buffer address (this rank's is buf's); fresh flags."""
        size = buf.element_size()
        deltas = [a - buf.data_ptr() for a in addresses]
        if addresses[rank] != buf.data_ptr() or any(d % 16 for d in deltas) or slot * size % 16:
            raise ValueError("the buffers must be 16-byte aligned (this rank's at `rank`), and "
                             f"the slot a multiple of 16 bytes (got {slot} x {size} bytes)")
        peers = torch.tensor([d // size for d in deltas], dtype=torch.int64, device=buf.device)
        flags = torch.zeros(4, dtype=torch.int32, device=buf.device)
        return PushBuffers(buf, peers, flags, rank, slot)


def push_constexprs(dtype: torch.dtype, world: int) -> dict:
    """The compile-time arguments of `push_message` for messages of `dtype` among `world` ranks
    (world 0: a kernel that does not push; placeholders)."""
    if world == 0:
        return {"WORLD": 1, "IDT": tl.int16, "MARK": 0}
    idt, mark = mark_dtype(dtype)
    return {"WORLD": world, "IDT": _TL_INT[idt], "MARK": mark}


@triton.jit
def _slot_ptr(BUF, PEERS, dst, IDT: tl.constexpr):
    # Base of rank dst's buffer (BUF: this rank's, typed IDT, the integer view of the message
    # dtype). The offsets are multiples of 16 bytes: said, so that the accesses vectorize.
    return BUF + tl.multiple_of(tl.load(PEERS + dst), 128 // IDT.primitive_bitwidth)


@triton.jit
def push_message(BUF, PEERS, rnd, x, offs, mask, rank, slot, WORLD: tl.constexpr,
                 IDT: tl.constexpr, MARK: tl.constexpr):
    """Store x (a block of this rank's partial, at element offsets `offs` of the message) into
    slot `rank` of round `rnd` (the call count in FLAGS, modulo 3) of every rank's buffer,
    -0.0 sent as +0.0 (the same value in any sum)."""
    bits = x.to(IDT, bitcast=True)
    bits = tl.where(bits == MARK, tl.zeros_like(bits), bits)
    at = (rnd * WORLD + rank).to(tl.int64) * slot + offs
    for dst in tl.static_range(WORLD):
        tl.store(_slot_ptr(BUF, PEERS, dst, IDT) + at, bits, mask=mask)


@triton.jit
def _wait_slots(ptrs, mask, MARK: tl.constexpr):
    # Spin until no element of the [slots, BLOCK] tile holds the mark; volatile loads see the
    # peers' stores. All slots at once: one load latency a poll, not one per rank.
    v = tl.load(ptrs, mask=mask, other=0, volatile=True)
    while tl.max(tl.max((v == MARK).to(tl.int32), axis=1), axis=0) > 0:
        v = tl.load(ptrs, mask=mask, other=0, volatile=True)
    return v


@triton.jit
def _push_all_reduce_kernel(
        X, stride_x, R, stride_r, S, stride_s, NW, Y, stride_y, BUF, PEERS, FLAGS,
        rank, N, slot, eps,
        WORLD: tl.constexpr, BLOCK: tl.constexpr, IDT: tl.constexpr, MARK: tl.constexpr,
        HAS_NORM: tl.constexpr, PUSHED: tl.constexpr, USE_PDL: tl.constexpr,
        WORLD_P2: tl.constexpr, EARLY: tl.constexpr):
    # One program per row of the message [M, N]. Without HAS_NORM: Y = sum over ranks of X.
    # With HAS_NORM: s = sum (rounded to the dtype, as an all-reduce returns it), S = R + s
    # (rounded: the new residual), Y = rms_norm(S) * NW, as longctx.ops.rms_norm rounds.
    # PUSHED: the producer of X already pushed it (kernels/gemv.py), X is not read.
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    if HAS_NORM:
        # The norm's weight (no kernel writes it) is loaded first, in the shadow of the wait for
        # the peers; after the sum it was a second memory latency on every call's critical path.
        nw = tl.load(NW + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM and PUSHED:
        # The residual comes from before the pushing GEMV, whose programs passed their PDL wait
        # on that work before this kernel could launch: it is read before the wait for the
        # peers. Read after it, its load queued behind the next GEMV's first weight tiles, in
        # flight by then with `early` (bench/results/allreduce-ready-flag-h200x2.txt).
        r = tl.load(R + row.to(tl.int64) * stride_r + offs, mask=mask, other=0.0)
    if USE_PDL and not PUSHED:
        # X is the predecessor's output. Dependents launch only after this wait: launched
        # earlier, the next GEMV's programs would take SMs from the predecessor still running.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    count = tl.load(FLAGS, volatile=True)
    prev = tl.load(FLAGS + 1, volatile=True)
    # Arrival among this call's programs; the last to arrive advances the count at its end
    # (every program has read it by then; none waits for another: they need not be resident
    # together). Its result is only needed there, so the atomic's latency overlaps the work.
    arrived = tl.atomic_add(FLAGS + 2, 1)
    rnd = count % 3
    at = row.to(tl.int64) * N + offs
    if not PUSHED:
        x = tl.load(X + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0)
        push_message(BUF, PEERS, rnd, x, at, mask, rank, slot, WORLD, IDT, MARK)
    # Clear the previous call's round while the peers' data travels: this program's share of
    # the prev elements of each slot, rounded up to 16 bytes (marks past them are marks
    # already; the slot is a multiple of 16 bytes) so that the stores vectorize.
    old = (rnd + 2) % 3
    step = tl.num_programs(0) * BLOCK
    VEC: tl.constexpr = 128 // IDT.primitive_bitwidth
    prev = tl.multiple_of((prev + VEC - 1) // VEC * VEC, VEC)
    for src in tl.static_range(WORLD):
        base = BUF + (old * WORLD + src).to(tl.int64) * slot
        for start in range(row * BLOCK, prev, step):
            start = tl.multiple_of(start, VEC)
            tl.store(base + start + offs, MARK, mask=start + offs < prev)
    if USE_PDL and PUSHED and EARLY:
        # The GEMV has ended here: the next one's programs launch and load their first weights
        # while this one waits for the peers.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    srcs = tl.arange(0, WORLD_P2)
    ptrs = BUF + (rnd * WORLD + srcs)[:, None].to(tl.int64) * slot + at[None, :]
    v = _wait_slots(ptrs, (srcs < WORLD)[:, None] & mask[None, :], MARK)
    v = v.to(Y.dtype.element_ty, bitcast=True).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for src in tl.static_range(WORLD):
        # Rank src's row (the other rows masked to +0.0, which adds exactly nothing): the sum in
        # rank order, the same bits on every rank.
        acc += tl.sum(tl.where((srcs == src)[:, None], v, 0.0), axis=0)
    if USE_PDL and PUSHED and not EARLY:
        # Every rank's GEMV has pushed: this one is ending. Wait for it before writing
        # (memory it may still read), then let the next GEMV launch.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    total = acc.to(Y.dtype.element_ty)
    if HAS_NORM:
        if not PUSHED:
            r = tl.load(R + row.to(tl.int64) * stride_r + offs, mask=mask, other=0.0)
        h = (r.to(tl.float32) + total.to(tl.float32)).to(Y.dtype.element_ty)
        tl.store(S + row.to(tl.int64) * stride_s + offs, h, mask=mask)
        hf = h.to(tl.float32)
        inv = tl.rsqrt(tl.sum(hf * hf, axis=0) / N + eps)
        total = (nw * (hf * inv).to(Y.dtype.element_ty).to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + row.to(tl.int64) * stride_y + offs, total, mask=mask)
    if arrived == tl.num_programs(0) - 1:
        tl.store(FLAGS + 2, 0)
        tl.store(FLAGS + 1, tl.num_programs(0) * N)
        tl.store(FLAGS, count + 1)


def push_all_reduce(x: torch.Tensor, bufs: PushBuffers, *, residual: torch.Tensor | None = None,
                    norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                    pushed: bool = False, num_warps: int | None = None, early: bool = False):
    """Sum over the ranks of x [M, N] (this rank's partial, unit stride in N), through the
    push protocol of this module, with this rank's `bufs` (M * N <= bufs.slot).

    With `residual` [M, N] and `norm_weight` [N]: returns (residual + sum,
    rms_norm(residual + sum) * norm_weight), each [M, N] in x's dtype, rounded as
    longctx.ops.rms_norm(residual, w, eps, add=sum) rounds; else the sum [M, N]. The sum is in
    float32 in rank order, rounded once: the same bits on every rank. pushed: x's producer
    already pushed it (x is not read; the residual must come from before that GEMV).
    num_warps: each row's program's warps (None: 4 to 16, one per 512 columns; a power of
    two). early (with pushed): let the next kernel launch once the GEMV has ended, before the
    wait for the peers' data (else after it). Every rank must make the same calls in the same
    order with the same M and N.
    """
    M, N = x.shape
    if M * N > bufs.slot:
        raise ValueError(f"the message has {M * N} elements, the buffers' slot {bufs.slot}")
    out = torch.empty_like(x)
    has_norm = norm_weight is not None
    s = torch.empty_like(x) if has_norm else out
    r = residual if has_norm else x
    BLOCK = next_power_of_2(N)
    if num_warps is None:
        num_warps = min(16, max(4, BLOCK // 512))
    elif num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two from 1 to 32, got {num_warps}")
    _push_all_reduce_kernel[(M,)](
        x, x.stride(0), r, r.stride(0), s, s.stride(0), norm_weight if has_norm else x, out,
        out.stride(0), bufs.buf, bufs.peers, bufs.flags, bufs.rank, N, bufs.slot, eps,
        BLOCK=BLOCK, **push_constexprs(x.dtype, bufs.peers.numel()), HAS_NORM=has_norm,
        PUSHED=pushed, WORLD_P2=next_power_of_2(bufs.peers.numel()), EARLY=early,
        num_warps=num_warps, **pdl_launch(x.device))
    return (s, out) if has_norm else out
