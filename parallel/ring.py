"""Ring attention for prefill: queries stay, K/V shards travel the ring, partial states merge.

The sequence is sharded over the W ranks of a process group in one of two layouts:

    contiguous: W chunks; rank r holds chunk r.
    zigzag:     2W chunks; rank r holds chunks r and 2W-1-r (in that order). Under a causal mask
                every rank then has the same amount of unmasked work at every ring step.

At step t rank r holds the K/V shard of rank (r - t) mod W. It computes the partial state
(O, LSE) of its queries against that shard, masked by the chunks' absolute positions (its own
shard in one causal call over local row order, which orders the same), skips chunk pairs that
the causal mask hides entirely, and folds the result into a float32 accumulator
(`attention_merge_into`: on CUDA the attention kernel merges in its epilogue, by merge_into's
rule). Meanwhile the shard is already on its way to rank r+1 and the next one is arriving
from rank r-1 (double buffering), so communication overlaps compute.

    >>> q_loc = shard_sequence(q, group, "zigzag")          # [B, S/W, Hq, D]
    >>> o_loc = ring_attention(q_loc, k_loc, v_loc, group=group, causal=True)
    >>> o = unshard_sequence(o_loc, group, "zigzag")        # [B, S, Hq, D]
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from longctx.attention import attention, attention_merge_into
from longctx.backend import use_triton_for
from longctx.checks import check_attention_inputs, check_flag, check_not_fp8, check_tensor
from longctx.parallel.process_group import all_gather_ints, global_rank, rank_and_world

__all__ = ["LAYOUTS", "TRANSPORTS", "ring_attention", "release_ring_buffers", "shard_sequence",
           "unshard_sequence", "shard_chunks"]

LAYOUTS = ("zigzag", "contiguous")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")


def _chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def shard_chunks(seq_len: int, world: int, rank: int, layout: str) -> list[tuple[int, int]]:
    """The chunks of a `seq_len` sequence that `rank` of `world` holds: (absolute start, length)
    pairs in local order. With one rank both layouts are the whole sequence, of any length.

    Raises ValueError for an unknown layout or a length the layout cannot split evenly.
    """
    _check_layout(layout)
    if world == 1:
        return [(0, seq_len)]
    n = world * _chunks_per_rank(layout)
    if seq_len % n:
        raise ValueError(
            f"sequence length {seq_len} must be divisible by {n} for layout {layout!r} on "
            f"{world} ranks ({_chunks_per_rank(layout)} equal chunk(s) per rank)"
        )
    c = seq_len // n
    ids = [rank, n - 1 - rank] if layout == "zigzag" else [rank]
    return [(i * c, c) for i in ids]


def _check_local_len(s_local: int, world: int, layout: str, name: str) -> None:
    _check_layout(layout)
    if world > 1 and s_local % _chunks_per_rank(layout):
        raise ValueError(
            f"{name} is {s_local}, but layout {layout!r} needs a local length divisible by "
            f"{_chunks_per_rank(layout)} (its chunks per rank)"
        )


def shard_sequence(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, layout: str = "zigzag", dim: int = 1
) -> torch.Tensor:
    """This rank's shard of a full sequence `x` (the same tensor on every rank).

    Args:
        x: any tensor whose dim `dim` is the sequence, e.g. q/k/v [B, S, H, D] or lse [B, S, H];
            S divisible by W (contiguous) or 2W (zigzag).
        group: the process group (None: the world).
        layout: "zigzag" or "contiguous".

    Returns:
        a new contiguous tensor, x's shape with S/W along `dim`, same dtype and device.
    """
    dim = _check_dim(x, dim)
    rank, world = rank_and_world(group)
    chunks = shard_chunks(x.shape[dim], world, rank, layout)
    # contiguous: cat keeps an input's memory format (channels_last, say)
    return torch.cat([x.narrow(dim, start, length) for start, length in chunks],
                     dim=dim).contiguous()


def unshard_sequence(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, layout: str = "zigzag", dim: int = 1
) -> torch.Tensor:
    """The full sequence from every rank's shard (all-gather); the inverse of `shard_sequence`.

    Args:
        x: this rank's shard, sequence along `dim` (S/W entries); every rank's shard must have the
            same shape and dtype (checked: one small extra collective).
        group, layout: as in `shard_sequence`.

    Returns:
        the full tensor, S along `dim`, identical on every rank; `x` itself with one rank.
    """
    rank, world = rank_and_world(group)
    dim = _check_dim(x, dim)
    _check_local_len(x.shape[dim], world, layout, f"x.shape[{dim}] (the local sequence length)")
    if world == 1:
        return x
    _check_same_across_ranks(
        {"x.shape": list(x.shape), "x.dtype": [_dtype_id(x.dtype)]}, group, x.device
    )
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    seq_len = x.shape[dim] * world
    pieces = []  # (absolute start, slice)
    for r, part in enumerate(parts):
        offset = 0
        for start, length in shard_chunks(seq_len, world, r, layout):
            pieces.append((start, part.narrow(dim, offset, length)))
            offset += length
    return torch.cat([p for _, p in sorted(pieces, key=lambda sp: sp[0])], dim=dim)


def _dtype_id(dtype: torch.dtype) -> int:
    """A number for every dtype, the same on every rank (for _check_same_across_ranks)."""
    return zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF


def _check_dim(x: torch.Tensor, dim: int) -> int:
    """x a tensor and dim one of its dims (negative counts from the end) -> dim >= 0."""
    check_tensor("x", x)
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape "
                         f"{tuple(x.shape)}, got {dim!r}")
    return dim % x.dim()


def _check_same_across_ranks(
    fields: dict[str, list[int]], group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """ValueError on every rank if any rank's `fields` differ (instead of a P2P hang later)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return  # the gather syncs the host; a captured graph replays checked shapes
    names = list(fields)
    flat = [x for n in names for x in fields[n]]
    rows = all_gather_ints(flat, group, device)
    if all(row == rows[0] for row in rows):
        return
    per_rank = []
    for r, row in enumerate(rows):
        it = iter(row)
        per_rank.append(f"rank {r}: " + ", ".join(
            f"{n}={[next(it) for _ in fields[n]]}" for n in names))
    raise ValueError("shards are inconsistent across ranks: " + "; ".join(per_rank))


# ------------------------------------------------------------------------- the ring
@dataclass(frozen=True)
class _Block:
    """One attention call of a ring step: local query rows [q0, q1) vs local key rows [k0, k1)."""

    q0: int
    q1: int
    k0: int
    k1: int
    masked: bool  # partly hidden by the causal mask; False: every key is visible to every query
    # Positions of query row q0 and key row k0 for the kernel's mask: absolute positions, or
    # any relabelling that keeps the order of every (query, key) pair of the block.
    q_start: int
    k_start: int


def _step_blocks(
    q_chunks: list[tuple[int, int]], k_chunks: list[tuple[int, int]], causal: bool
) -> list[_Block]:
    """The attention calls that cover every visible (query chunk, key chunk) pair of one step."""
    increasing = all(a + n <= b for (a, n), (b, _) in zip(q_chunks, q_chunks[1:]))
    if causal and q_chunks == k_chunks and increasing:
        # A rank's own shard: queries and keys hold the same positions in increasing order, so
        # the mask is causal in local row order. One call instead of one per chunk pair (zigzag:
        # two diagonal blocks and one full block, the same tiles) keeps the GPU fuller.
        n = sum(length for _, length in q_chunks)
        return [_Block(0, n, 0, n, True, 0, 0)]
    blocks = []
    q_off = 0
    for qa, ql in q_chunks:
        k_off = 0
        for ka, kl in k_chunks:
            if not causal or ka + kl - 1 <= qa:  # last key at or before the first query
                blocks.append(_Block(q_off, q_off + ql, k_off, k_off + kl, False, qa, ka))
            elif ka <= qa + ql - 1:  # else the first key is after the last query: skip
                blocks.append(_Block(q_off, q_off + ql, k_off, k_off + kl, True, qa, ka))
            k_off += kl
        q_off += ql
    return _coalesce(blocks)


def _coalesce(blocks: list[_Block]) -> list[_Block]:
    """Join unmasked blocks that are adjacent in local rows into one call: without a mask,
    absolute positions do not matter. E.g. a zigzag step where both query chunks see the whole
    first key chunk becomes one call over both query chunks."""
    blocks = list(blocks)
    joined = True
    while joined:
        joined = False
        for i, a in enumerate(blocks):
            for j, b in enumerate(blocks):
                if i == j or a.masked or b.masked:
                    continue
                if (a.q0, a.q1) == (b.q0, b.q1) and a.k1 == b.k0:
                    new = replace(a, k1=b.k1)
                elif (a.k0, a.k1) == (b.k0, b.k1) and a.q1 == b.q0:
                    new = replace(a, q1=b.q1)
                else:
                    continue
                blocks = [x for n, x in enumerate(blocks) if n not in (i, j)] + [new]
                joined = True
                break
            if joined:
                break
    return sorted(blocks, key=lambda b: (b.q0, b.k0))


TRANSPORTS = ("auto", "copy_engine", "nccl")


class _RingNccl:
    """Sends K/V to the next rank and receives the previous rank's through NCCL (any backend),
    one step ahead of compute, into two receive buffers taken in turn.

    On CUDA the P2P ops are issued from a side stream, ordered after the work already queued on
    the compute stream, and the compute stream waits for them only when it needs the data, so
    the transfer of step t+1 overlaps the attention of step t. No host synchronisation.
    (Overlapped rings once gave results that changed from run to run: merge_into's in-place
    update raced between warps when NCCL's kernels shared the SMs; tests/test_ring_gpu.py.)
    """

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world: int,
                 kv: tuple[torch.Tensor, torch.Tensor]):
        self.group = group
        self.next = global_rank(group, (rank + 1) % world)
        self.prev = global_rank(group, (rank - 1) % world)
        device = kv[0].device
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.bufs = [tuple(torch.empty_like(t) for t in kv) for _ in range(min(2, world - 1))]

    def start(self, send: tuple[torch.Tensor, ...], slot: int) -> tuple[list, int]:
        """Send `send` to the next rank while receiving the previous rank's into buffer `slot`.
        Buffer `slot` must no longer be read by queued compute other than what precedes this."""
        recv = self.bufs[slot]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recv]
        if self.stream is None:
            return dist.batch_isend_irecv(ops), slot
        # The compute stream has queued the writes of `send` and the last reads of `recv`.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            works = dist.batch_isend_irecv(ops)
        for t in (*send, *recv):
            # The allocator must not recycle these while the side stream may still use them.
            t.record_stream(self.stream)
        return works, slot

    def finish(self, pending: tuple[list, int]) -> tuple[torch.Tensor, ...]:
        """The received shard, visible to the compute stream (on CPU: block until done)."""
        works, slot = pending
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx:
            for w in works:
                w.wait()  # CUDA: the current (side) stream waits for the NCCL stream, host does not
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return self.bufs[slot]

    def close(self) -> None:
        pass


class _RingCopyEngine:
    """GPUs of one host: each step's K/V shard is pushed by the copy engines straight into the
    next rank's receive buffers, in torch symmetric memory (peer-mapped; no NVLink multicast).

    Why not NCCL: its send/recv kernels need SMs. Beside the attention kernel they slowed it by
    ~25% for the whole step, and when the attention kernel took the SMs first they ran only in
    its last wave, after it (bench/ring_timeline.py: 4x H200, 131072 tokens). A copy-engine
    push uses no SMs. The ordering between ranks is kept by counters in the same buffers
    (kernels/ring_sync.py), set and awaited by one tiny kernel on the compute stream between
    two attention steps, where every SM is free: before a step that pushes into the next rank's
    slot, wait until that rank has released the slot as often as it was filled; after a step,
    once this rank's push has finished, tell the next rank its slot is filled, release the slot
    this step read to the previous rank, and wait until this rank's own slot is filled.

    The buffers (2 slots x the K and V shard, and the counters) are kept between calls, per
    group, device and dtype, and grow when a call needs more: `release_ring_buffers()` frees
    them.
    """

    _cache: dict = {}  # (group name, device, dtype) -> _RingBuffers

    def __init__(self, group: dist.ProcessGroup, rank: int, world: int,
                 kv: tuple[torch.Tensor, torch.Tensor]):
        k, v = kv
        self.device = k.device
        self.shapes, self.sizes = (k.shape, v.shape), (k.numel(), v.numel())
        key = (group.group_name, self.device, k.dtype)
        bufs = self._cache.get(key)
        if bufs is None or bufs.cap < k.numel() + v.numel():
            # Every rank holds the same shapes (checked): all come here together.
            if bufs is not None:
                # The old buffers may still be read or written by queued work, here or on a
                # peer: every rank drains its GPU before any frees them.
                torch.cuda.synchronize(self.device)
                dist.barrier(group)
            self._cache.pop(key, None)
            del bufs
            bufs = self._cache[key] = _RingBuffers(group, rank, world, k.numel() + v.numel(), k)
        self.b = bufs
        self.mine = [self._views(bufs.mine, s) for s in range(2)]
        self.peer = [self._views(bufs.next, s) for s in range(2)]
        self.reading = None  # the receive slot the step just queued reads
        self.stream = torch.cuda.Stream(self.device)

    def _views(self, flat: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        (nk, nv), o = self.sizes, slot * self.b.cap
        return flat[o:o + nk].view(self.shapes[0]), flat[o + nk:o + nk + nv].view(self.shapes[1])

    def _sync(self, **kw) -> None:
        from longctx.kernels.ring_sync import ring_sync

        ring_sync(self.b.flags, self.b.next_flags, self.b.prev_flags, **kw)

    def start(self, send: tuple[torch.Tensor, ...], slot: int) -> int:
        """Push `send` into the next rank's receive slot `slot`, beside the next step."""
        b = self.b
        if b.pushes[slot]:  # the next rank has read what earlier pushes left there
            self._sync(wait_free=(slot, b.pushes[slot]))
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src in zip(self.peer[slot], send):
                dst.copy_(src)  # peer-mapped destination: a copy-engine transfer over NVLink
        # No record_stream: the compute stream waits for this stream in `finish`, and the call
        # finishes every step it starts, so nothing it read is freed before the push is done.
        return slot

    def finish(self, slot: int) -> tuple[torch.Tensor, ...]:
        """After the step queued beside the push: this rank's receive slot `slot`, filled."""
        b = self.b
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        b.pushes[slot] += 1
        free = None
        if self.reading is not None:
            b.reads[self.reading] += 1
            free = (self.reading, b.reads[self.reading])
        self._sync(arrived=(slot, b.pushes[slot]), free=free, wait_arrived=(slot, b.pushes[slot]))
        self.reading = slot
        return self.mine[slot]

    def close(self) -> None:
        """After the last step: release the slot it read."""
        if self.reading is not None:
            self.b.reads[self.reading] += 1
            self._sync(free=(self.reading, self.b.reads[self.reading]))
            self.reading = None


class _RingBuffers:
    """The copy-engine ring's symmetric memory: 2 receive slots of `cap` elements and 4 int32
    counters (kernels/ring_sync.py) per rank, with the next and previous ranks' peer-mapped
    views, and how often each slot was filled (pushes) and read (reads) on every rank alike."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world: int, cap: int,
                 like: torch.Tensor):
        import torch.distributed._symmetric_memory as symm_mem

        from longctx.parallel.allreduce import enable_symmetric_memory

        enable_symmetric_memory(group)
        pad = 16 // like.element_size()  # 16 bytes for the counters
        n = 2 * cap + pad
        buf = symm_mem.empty(n, dtype=like.dtype, device=like.device)
        self.handle = symm_mem.rendezvous(buf, group.group_name)
        peer = [self.handle.get_buffer(r, (n,), like.dtype, 0) for r in range(world)]
        self.group, self.cap, self.mine, self.next = group, cap, buf, peer[(rank + 1) % world]
        self.flags, self.next_flags, self.prev_flags = (
            x[2 * cap:].view(torch.int32) for x in (buf, self.next, peer[(rank - 1) % world]))
        self.pushes, self.reads = [0, 0], [0, 0]
        self.flags.zero_()
        self.handle.barrier(channel=0)  # every rank's counters are zero before any is set


def release_ring_buffers() -> None:
    """Free the copy-engine ring's cached symmetric-memory buffers, once every rank's queued
    work is done (collective: every rank of the groups that used them must call it)."""
    for bufs in _RingCopyEngine._cache.values():
        torch.cuda.synchronize(bufs.mine.device)
        dist.barrier(bufs.group)
    _RingCopyEngine._cache.clear()


# (group name, device) -> why the copy-engine ring is unavailable there ("": it is available)
_transport_ok: dict = {}


def _make_transport(transport: str, group: dist.ProcessGroup | None, rank: int, world: int,
                    kv: tuple[torch.Tensor, torch.Tensor]):
    """The ring's K/V transport: "copy_engine" on CUDA GPUs of one host with torch symmetric
    memory, "nccl" otherwise; "auto" picks the first that works (collective, once per group)."""
    if transport == "nccl" or kv[0].device.type != "cuda":
        if transport == "copy_engine":
            raise ValueError("transport='copy_engine' needs CUDA tensors")
        return _RingNccl(group, rank, world, kv)
    if torch.cuda.is_current_stream_capturing():
        # The copy-engine ring's counters advance on the host at every call: a graph would
        # replay the first call's values.
        if transport == "copy_engine":
            raise ValueError("transport='copy_engine' cannot be captured in a CUDA graph; use "
                             "'nccl' or 'auto'")
        return _RingNccl(group, rank, world, kv)
    group = group or dist.group.WORLD
    key = (group.group_name, kv[0].device)
    if key not in _transport_ok:
        from longctx.parallel.allreduce import on_every_rank

        ring, _transport_ok[key] = on_every_rank(
            group, kv[0].device, lambda: _RingCopyEngine(group, rank, world, kv))
        if ring is not None:
            return ring
    if not _transport_ok[key]:
        return _RingCopyEngine(group, rank, world, kv)
    if transport == "copy_engine":
        raise RuntimeError(f"transport='copy_engine' is unavailable: {_transport_ok[key]}")
    return _RingNccl(group, rank, world, kv)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    layout: str = "zigzag",
    softmax_scale: float | None = None,
    return_lse: bool = False,
    transport: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's query shard over the whole sequence, K/V shards passed round a ring.

    Args:
        q: [B, S_local, Hq, D] this rank's query shard in `layout` (S_local = S / W).
        k, v: [B, S_local, Hkv, D] this rank's K/V shard (Hq % Hkv == 0; only the Hkv heads
            travel). Read, never written: afterwards they are this rank's part of the KV cache.
        group: the process group whose ranks hold the shards (None: the world). Every rank must
            call with the same shapes, dtype, `causal` and `layout` (checked once per call: one
            small collective, a host synchronisation on CUDA).
        causal: mask by absolute position in the full sequence.
        layout: "zigzag" (S_local even; balanced causal work) or "contiguous".
        softmax_scale: defaults to 1/sqrt(D).
        return_lse: also return the LSE.
        transport: how K/V shards travel: "copy_engine" (CUDA GPUs of one host: copy-engine
            pushes into torch symmetric memory, no SMs taken from the attention kernel; its
            buffers are cached between calls, see `release_ring_buffers`), "nccl" (send/recv,
            any backend), or "auto" (copy_engine where it can be set up, else nccl).

    Returns:
        o [B, S_local, Hq, D] in q's dtype, this rank's output shard in `layout`; with return_lse
        also lse [B, S_local, Hq] float32 (float64 for float64 inputs), natural log. With one
        rank (or no process group initialised) this is `longctx.attention`.
    """
    check_not_fp8("ring_attention", k, v)  # the ring's in-flight K/V stay in q's dtype
    check_attention_inputs(q, k, v, softmax_scale)
    check_flag("causal", causal)
    check_flag("return_lse", return_lse)
    _check_layout(layout)
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(map(repr, TRANSPORTS))}, got "
                         f"{transport!r}")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"q and k must hold the same local sequence length: q.shape[1] is "
                         f"{q.shape[1]}, k.shape[1] is {k.shape[1]}")
    rank, world = rank_and_world(group)
    if world == 1:
        return attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)
    B, s_local, hq, d = q.shape
    _check_local_len(s_local, world, layout, "q.shape[1] (the local sequence length)")
    _check_same_across_ranks(
        {"q.shape": list(q.shape), "k.shape": list(k.shape), "dtype": [_dtype_id(q.dtype)],
         "causal": [int(causal)], "layout": [LAYOUTS.index(layout)]},
        group, q.device,
    )

    seq_len = s_local * world
    q_chunks = shard_chunks(seq_len, world, rank, layout)
    # Step t visits the shard of rank (rank - t) mod W. Planned up front: the loop only launches.
    plans = [_step_blocks(q_chunks, shard_chunks(seq_len, world, (rank - t) % world, layout), causal)
             for t in range(world)]
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    # The kernel's fused merge never reads o_acc where lse_acc is -inf, and every row is written
    # (each query chunk sees at least its own positions), so it needs no zero fill; the torch
    # merge (reference backend) weights o_acc by 0 there, which needs finite values.
    o_acc = (torch.empty if use_triton_for(q) else torch.zeros)(
        B, s_local, hq, d, dtype=acc_dtype, device=q.device)
    lse_acc = torch.full((B, s_local, hq), float("-inf"), dtype=acc_dtype, device=q.device)

    kv = (k.contiguous(), v.contiguous())  # step 0 reads this rank's own shard in place
    ring = _make_transport(transport, group, rank, world, kv)
    for t, blocks in enumerate(plans):
        # Post the transfer for step t+1 before computing step t. Buffer t % 2 was last read by
        # step t-1's compute and last sent during step t-1, both ordered before this receive.
        pending = ring.start(kv, t % 2) if t + 1 < world else None
        kt, vt = kv
        for b in blocks:
            attention_merge_into(
                o_acc[:, b.q0:b.q1], lse_acc[:, b.q0:b.q1],
                q[:, b.q0:b.q1], kt[:, b.k0:b.k1], vt[:, b.k0:b.k1], causal=b.masked,
                softmax_scale=softmax_scale, q_start=b.q_start, k_start=b.k_start,
            )
        if pending is not None:
            kv = ring.finish(pending)
    ring.close()

    o = o_acc.to(q.dtype)
    if not return_lse:
        return o
    return o, lse_acc
