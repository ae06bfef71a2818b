"""The sums of tensor-parallel decoding: the row-parallel projections' partial outputs, [M, dim]
with M <= 16 rows per step (16 KB at batch 1 for CodeLlama-34B, two per layer).

`PushAllReduce` runs them as one push kernel each (kernels/allreduce.py: every rank stores its
partial into every peer's buffer and spins on its own; no barrier round trip), fused with the
residual add and RMSNorm that follow, and launched with programmatic dependent launch so the next
GEMV's weights stream while it waits. Its buffers come from torch symmetric memory (peer-mapped
over NVLink; no multicast). What it cannot carry (larger messages: prefill; other dtypes) goes
through NCCL, and `make_all_reduce` picks NCCL for everything where symmetric memory is missing
or the group spans hosts.
"""

from __future__ import annotations

import logging
import socket
import warnings

import torch
import torch.distributed as dist

from longctx.config import ALL_REDUCE_KINDS
from longctx.kernels.allreduce import ROUNDS, PushBuffers, mark_dtype, push_all_reduce
from longctx.ops import gemv_applies, linear, rms_norm, skinny_applies

log = logging.getLogger("longctx")

# Rows a decode step's message may have (batch x 1 position); larger go to NCCL.
MAX_ROWS = 16


class NcclAllReduce:
    """The sums through NCCL (or gloo on CPU): all_reduce, then the norm kernel."""

    name = "nccl"

    def __init__(self, group) -> None:
        self.group = group

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial output x @ weight^T (longctx.ops.linear)."""
        return linear(x, weight)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group: x reduced in place and returned, or, for a view with
        gaps (e.g. the last position of each sequence), a reduced contiguous copy."""
        if not x.is_contiguous():
            x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def add_rms_norm(self, residual: torch.Tensor, partial: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + s, rms_norm(residual + s) * weight) with s the sum of `partial` over the
        group: longctx.ops.rms_norm(residual, weight, eps, add=s)."""
        return rms_norm(residual, weight, eps, self.all_reduce(partial))


class PushAllReduce(NcclAllReduce):
    """Decode-sized sums through the push kernel of kernels/allreduce.py; NCCL for the rest.

    bufs: this rank's PushBuffers (messages of `dtype`); `symmetric` allocates them in torch
    symmetric memory. `keepalive` holds what owns the buffers. push_gemv: `linear` lets a
    batch-1 GEMV or a batch 2-16 skinny GEMM push its output itself. num_warps: the push
    kernel's warps per row (None: its rule; bench/allreduce.py `--warps` times others). early:
    the push kernel after a pushing GEMV lets the next kernel launch before it waits for the
    peers (`push_all_reduce`), else after; bench/allreduce.py `--early` times the other.

    Early is faster at every group size now that the push kernel reads the residual before
    that wait: CodeLlama-34B at 16k on 4x H100, tp=4 146.8-146.9 tok/s against 145.4-145.6
    (bench/results/allreduce-early-h100x4.txt, before that read, when tp=2 tied: 80.7 against
    80.8); on 2x H200 after it, chains of 48 tp=2 layers 168.5-168.8 µs a layer against
    169.5-170.0 (bench/results/allreduce-ready-flag-h200x2.txt) and the model +0.6% at 16k,
    +0.9% at batch 8 x 32k (bench/results/model/ab-early-residual-tp2-h200x2.txt).
    """

    def __init__(self, group, bufs: PushBuffers, dtype: torch.dtype, keepalive: object = None,
                 push_gemv: bool = False, num_warps: int | None = None,
                 early: bool = True) -> None:
        super().__init__(group)
        self.bufs, self.dtype, self.keepalive = bufs, dtype, keepalive
        self.num_warps = num_warps  # the push kernel's (None: its rule)
        self.early = early
        self.device = bufs.buf.device
        self.push_gemv = push_gemv
        self.name = "push_gemv" if push_gemv else "push"
        self._pushed: torch.Tensor | None = None  # a GEMV output already in the buffers

    @classmethod
    def symmetric(cls, group, device: torch.device, dtype: torch.dtype, dim: int,
                  push_gemv: bool = False, num_warps: int | None = None,
                  early: bool = True) -> "PushAllReduce":
        """Buffers for messages of up to MAX_ROWS x dim elements in torch symmetric memory,
        mapped between the GPUs of `group` (one host). Collective over the group."""
        import torch.distributed._symmetric_memory as symm_mem

        name = group.group_name
        enable_symmetric_memory(group)
        world = dist.get_world_size(group)
        idt, mark = mark_dtype(dtype)
        slot = -(-MAX_ROWS * dim // 8) * 8  # 16-byte multiples
        buf = symm_mem.empty(ROUNDS * world * slot, dtype=idt, device=device)
        handle = symm_mem.rendezvous(buf, name)
        buf.fill_(mark)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every buffer holds marks before anyone pushes
        bufs = PushBuffers.from_addresses(buf, list(handle.buffer_ptrs), dist.get_rank(group),
                                          slot)
        return cls(group, bufs, dtype, handle, push_gemv, num_warps, early)

    def carries(self, x: torch.Tensor) -> bool:
        """Whether the push kernel takes x (else NCCL): the buffers' dtype and device, at most
        `slot` elements, rows of unit stride."""
        return (x.dtype == self.dtype and x.device == self.device
                and 0 < x.numel() <= self.bufs.slot and x.dim() >= 1 and x.stride(-1) == 1)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """With push_gemv, a batch-1 GEMV or a batch 2-16 skinny GEMM stores its output into
        the buffers itself; the next reduction (which must be of that output) then only waits
        and sums."""
        if (self.push_gemv and x.dtype == self.dtype and x.device == self.device
                and x.numel() // x.shape[-1] * weight.shape[0] <= self.bufs.slot):
            from longctx.kernels.gemv import gemv, skinny_gemm

            if gemv_applies(x, weight):
                self._pushed = gemv(x, weight, push=self.bufs)
                return self._pushed
            if skinny_applies(x, weight):
                self._pushed = skinny_gemm(x, weight, push=self.bufs)
                return self._pushed
        return linear(x, weight)

    def _take_pushed(self, x: torch.Tensor) -> bool:
        # Whether x is (a view of all of) the GEMV output pushed last; forgets it either way.
        p, self._pushed = self._pushed, None
        return p is not None and x.data_ptr() == p.data_ptr() and x.numel() == p.numel()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group: a new tensor (push kernel), or x in place (NCCL)."""
        pushed = self._take_pushed(x)
        if not self.carries(x):
            return super().all_reduce(x)
        return push_all_reduce(x.reshape(-1, x.shape[-1]), self.bufs, pushed=pushed,
                               num_warps=self.num_warps).view(x.shape)

    def add_rms_norm(self, residual: torch.Tensor, partial: torch.Tensor, weight: torch.Tensor,
                     eps: float, pushed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """As NcclAllReduce's, in one push kernel where it carries `partial`. pushed: the GEMV
        that produced `partial` already pushed it (kernels/gemv.py with `push`; `linear` with
        push_gemv tracks this itself)."""
        pushed = self._take_pushed(partial) or pushed
        if not (self.carries(partial) and residual.shape == partial.shape
                and residual.dtype == partial.dtype and residual.stride(-1) == 1):
            if pushed:
                raise ValueError("a pushed partial must be one the push kernel carries")
            return super().add_rms_norm(residual, partial, weight, eps)
        N = partial.shape[-1]
        s, y = push_all_reduce(partial.reshape(-1, N), self.bufs,
                               residual=residual.reshape(-1, N), norm_weight=weight, eps=eps,
                               pushed=pushed, num_warps=self.num_warps, early=self.early)
        return s.view(partial.shape), y.view(partial.shape)


def enable_symmetric_memory(group) -> None:
    """Let torch symmetric memory rendezvous over `group`: a call older torch releases need
    (newer ones warn that it is no longer needed)."""
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)


def same_host(group) -> bool:
    """Whether every rank of `group` runs on this host (collective over the group)."""
    names = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return len(set(names)) == 1


def on_every_rank(group, device: torch.device, setup) -> tuple[object | None, str]:
    """Run `setup()` (a symmetric-memory path's set-up) on every rank of `group`, whose GPUs must
    be on one host: (its result, "") where it worked on every rank, else (None, why) on every
    rank, so that all of them take the same path. Collective over the group."""
    result, reason = None, ""
    if not same_host(group):
        reason = "the group spans hosts"
    else:
        try:
            result = setup()
        except Exception as e:  # no symmetric memory in this torch, or no peer access
            reason = f"{type(e).__name__}: {e}"
    ok = torch.tensor([result is not None], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if bool(ok.item()):
        return result, ""
    return None, reason or "another rank could not set it up"


def make_all_reduce(group, device: torch.device, dtype: torch.dtype, dim: int,
                    kind: str = "auto") -> NcclAllReduce:
    """The tensor-parallel sums of `group` for a model of width `dim` in `dtype` on `device`.

    kind: "push" (the push kernel, fused with the residual add and RMSNorm), "push_gemv" (as
    push, and the row-parallel GEMVs (batch 1) and skinny GEMMs (batch 2-16) push their own
    output: the fastest, bench/allreduce.py), "auto" (push_gemv on CUDA where torch symmetric
    memory maps the group's GPUs, all on one host; else NCCL) or "nccl". push and push_gemv
    raise where they cannot be set up. Collective over the group: every rank gets the same kind."""
    if kind not in ALL_REDUCE_KINDS:
        raise ValueError(f"parallel.all_reduce must be one of {', '.join(ALL_REDUCE_KINDS)}, "
                         f"got {kind!r}")
    if kind == "nccl" or device.type != "cuda":
        if kind != "auto" and kind != "nccl":
            raise ValueError(f"parallel.all_reduce={kind} needs CUDA devices")
        return NcclAllReduce(group)
    comm, reason = on_every_rank(
        group, device, lambda: PushAllReduce.symmetric(group, device, dtype, dim, kind != "push"))
    if comm is not None:
        log.info(f"tensor parallel: decode sums through the push kernel ({comm.name}), fused with "
                 "the residual add and RMSNorm")
        return comm
    if kind != "auto":
        raise RuntimeError(f"parallel.all_reduce={kind} is unavailable: {reason}")
    log.warning(f"push all-reduce unavailable ({reason}); tensor parallelism uses NCCL")
    return NcclAllReduce(group)
