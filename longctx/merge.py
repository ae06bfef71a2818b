"""The merge layer: the single place where partial attention states are combined.

An attention state over a set of keys K is the pair (O, LSE):

    LSE = log(sum_{j in K} exp(s_j))            natural log, float32
    O   = sum_{j in K} exp(s_j - LSE) * v_j     the softmax-weighted output over K

For disjoint key sets A and B the state over A u B is

    LSE = log(exp(LSE_A) + exp(LSE_B))
    O   = exp(LSE_A - LSE) * O_A + exp(LSE_B - LSE) * O_B

This operator is exact, commutative and associative (up to rounding), so KV splits on one GPU
(Flash-Decoding), ring-attention steps and KV shards on other GPUs all merge through it. The
empty state (O = 0, LSE = -inf) is its identity: a part that saw no key contributes nothing, and
merging only empty parts gives O = 0, LSE = -inf, never NaN.

    >>> o = torch.randn(2, 4, 8, 64)          # [parts, batch, heads, head_dim]
    >>> lse = torch.randn(2, 4, 8)            # [parts, batch, heads]
    >>> o_all, lse_all = merge_states(o, lse)   # o_all [4, 8, 64], lse_all [4, 8]

On CUDA tensors one Triton kernel (longctx.kernels.merge) does the N-way merge in one launch;
on CPU, and for float64 states anywhere, the torch implementation below runs. Math is float32
(float64 when the inputs are).
"""

from __future__ import annotations

import torch

from longctx.backend import use_triton_for
from longctx.checks import check_flag, check_no_overlap, check_tensor

__all__ = ["merge_states", "merge_into", "merge_states_group", "merge_states_torch", "check_lse"]


def _math_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


# longctx.kernels.launch and .merge, imported on first use (CPU-only use never imports Triton).
_kl = _km = None


def _kernels():
    global _kl, _km
    if _kl is None:
        from longctx.kernels import launch as kl, merge as km

        _kl, _km = kl, km
    return _kl


# Validated plans by input signature: (current device, device index, dtype, shape and strides of
# every tensor argument, whether PDL is allowed). The shape checks and everything a plan computes
# are functions of these; value checks (`check`) run per call.
_STATES_PLANS: dict = {}
_INTO_PLANS: dict = {}


def check_lse(lse: torch.Tensor, name: str = "lse") -> None:
    """Raise ValueError if `lse` holds +inf or NaN (-inf, the empty state, is allowed).

    Costs one host synchronisation on CUDA, so it is skipped while a CUDA graph is captured.
    """
    if lse.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    bad = torch.isnan(lse) | (lse == float("inf"))
    if bool(bad.any()):
        raise ValueError(
            f"{name} must be finite or -inf (the empty state); found {int(bad.sum())} "
            "entries that are +inf or NaN"
        )


def _dtypes(*ts: object) -> tuple:
    """The tensors' dtypes (None for what is not a tensor: validation names it)."""
    return tuple(getattr(t, "dtype", None) for t in ts)


def _check_values(check: bool | None, lse: torch.Tensor, name: str) -> None:
    """`check_lse` where `check` asks for it: True, or None for a CPU tensor (free to read)."""
    if check is not None:
        check_flag("check", check)
    if check or (check is None and not lse.is_cuda):
        check_lse(lse, name)


def _check_pair(o: torch.Tensor, lse: torch.Tensor, o_name: str, lse_name: str) -> None:
    check_tensor(o_name, o)
    check_tensor(lse_name, lse)
    if o.dim() < 2 or lse.shape != o.shape[:-1]:
        raise ValueError(
            f"{lse_name} must have the shape of {o_name} without its last (head_dim) dim: "
            f"{o_name} {tuple(o.shape)}, {lse_name} {tuple(lse.shape)}"
        )
    if o.shape[-1] == 0:
        raise ValueError(f"{o_name}'s last dim (head_dim) must be at least 1, got shape "
                         f"{tuple(o.shape)}")
    if not o.is_floating_point():
        raise ValueError(f"{o_name} must be a floating-point tensor, got {o.dtype}")
    if lse.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{lse_name} must be float32 (natural log), got {lse.dtype}")
    if o.device != lse.device:
        raise ValueError(f"{o_name} is on {o.device} but {lse_name} on {lse.device}")


def merge_states_torch(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch implementation of the N-way merge (no input checks); see `merge_states`."""
    dt = _math_dtype(o, lse)
    lse = lse.to(dt)
    m = lse.amax(dim=0)
    # All parts empty: shift by 0 instead of -inf so that exp() gives 0 rather than NaN.
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m)  # [P, ..., H]; exactly 0 for empty parts
    s = w.sum(dim=0)
    lse_out = m + torch.log(s)  # log(0) = -inf for rows where every part is empty
    w = w.unsqueeze(-1)
    # where(): an empty part contributes nothing even if its O holds garbage.
    o_sum = torch.where(w > 0, w * o.to(dt), torch.zeros((), dtype=dt, device=o.device)).sum(0)
    o_out = o_sum / torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)
    return o_out, lse_out


def merge_states(
    o: torch.Tensor, lse: torch.Tensor, *, check: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge P partial attention states over the leading dim.

    Args:
        o: [P, ..., H, D] partial outputs, any float dtype. A part whose lse is -inf is ignored
            (its o is never read into the result).
        lse: [P, ..., H] float32 natural-log log-sum-exp of each part (float64 is accepted and
            then the math is float64).
        check: raise ValueError if lse holds +inf or NaN. None (default): for CPU tensors, where
            reading the values is free; not for CUDA tensors, where it costs a host sync per
            call (unchecked, such an entry gives its row a NaN merged LSE). True: also on CUDA
            (skipped during CUDA-graph capture). False: never.

    Returns:
        (o [..., H, D] in o's dtype, lse [..., H] float32; float64 if the inputs were).

    On CUDA a call with an input signature seen before skips the shape checks and launches the
    kernel directly (longctx.kernels.launch).
    """
    # float32 kernel; getattr: a non-tensor argument reaches the validation's ValueError
    kernel = use_triton_for(o) and torch.float64 not in _dtypes(o, lse)
    if kernel and (kl := _kl or _kernels()).fast_launch_active():
        dev = kl.current_device()
        try:
            sig = kl.signature
            key = (dev, sig(o), sig(lse), kl.pdl_allowed())
            plan = _STATES_PLANS.get(key)
        except (AttributeError, TypeError):
            key = plan = None
        if plan is None:
            _check_states(o, lse)
            plan = _km.MergeStatesPlan(o, lse)
            if key is not None:
                kl.remember(_STATES_PLANS, key, plan)
        _check_values(check, lse, "lse")
        return plan(o, lse, dev)
    _check_states(o, lse)
    _check_values(check, lse, "lse")
    if kernel:
        _kernels()
        return _km.merge_states_triton(o, lse)
    o_out, lse_out = merge_states_torch(o, lse)
    return o_out.to(o.dtype), lse_out.to(_math_dtype(lse))


def _check_states(o: torch.Tensor, lse: torch.Tensor) -> None:
    _check_pair(o, lse, "o", "lse")
    if o.shape[0] == 0:
        raise ValueError("o and lse need at least one part in their leading dim, got 0")


def merge_into(
    o_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    check: bool | None = None,
) -> None:
    """In place: (o_acc, lse_acc) <- merge((o_acc, lse_acc), (o, lse)). Used by ring steps.

    Args:
        o_acc: [..., H, D] float32 accumulator (start it at zeros).
        lse_acc: [..., H] float32 accumulator (start it at -inf: the empty state).
        o: [..., H, D] the new partial output, any float dtype.
        lse: [..., H] float32 natural-log LSE of the new part.
        check: as in `merge_states` (for lse and lse_acc).
    """
    kernel = use_triton_for(o) and torch.float64 not in _dtypes(o_acc, lse_acc, o, lse)
    if kernel and (kl := _kl or _kernels()).fast_launch_active():
        dev = kl.current_device()
        try:
            sig = kl.signature
            key = (dev, sig(o_acc), sig(lse_acc), sig(o), sig(lse), kl.pdl_allowed())
            plan = _INTO_PLANS.get(key)
        except (AttributeError, TypeError):
            key = plan = None
        if plan is None:
            _check_into(o_acc, lse_acc, o, lse)
            plan = _km.MergeIntoPlan(o_acc, lse_acc, o, lse)
            if key is not None:
                kl.remember(_INTO_PLANS, key, plan)
        _check_values(check, lse, "lse")
        _check_values(check, lse_acc, "lse_acc")
        plan(o_acc, lse_acc, o, lse, dev)
        return
    _check_into(o_acc, lse_acc, o, lse)
    _check_values(check, lse, "lse")
    _check_values(check, lse_acc, "lse_acc")
    if kernel:
        _kernels()
        _km.merge_into_triton(o_acc, lse_acc, o, lse)
        return
    o_new, lse_new = merge_states_torch(
        torch.stack([o_acc, o.to(o_acc.dtype)]), torch.stack([lse_acc, lse.to(lse_acc.dtype)])
    )
    o_acc.copy_(o_new)
    lse_acc.copy_(lse_new)


def _check_into(o_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor,
                lse: torch.Tensor) -> None:
    _check_pair(o_acc, lse_acc, "o_acc", "lse_acc")
    _check_pair(o, lse, "o", "lse")
    if o_acc.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"o_acc must be a float32 accumulator, got {o_acc.dtype}")
    if o.shape != o_acc.shape:
        raise ValueError(f"o {tuple(o.shape)} must match o_acc {tuple(o_acc.shape)}")
    if o.device != o_acc.device:
        raise ValueError(f"o is on {o.device} but o_acc on {o_acc.device}")
    check_no_overlap("o_acc", o_acc)
    check_no_overlap("lse_acc", lse_acc)


def merge_states_group(
    o: torch.Tensor, lse: torch.Tensor, group: "torch.distributed.ProcessGroup | None" = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the partial states held by every rank of a process group (sequence-parallel decode).

    Each rank holds the state of its own KV shard; all ranks get the merged state. One
    all-gather of W x (|o| + |lse|) -- a few KB per decode step -- then the local N-way merge.

    Args:
        o: [..., H, D] this rank's partial output (any float dtype).
        lse: [..., H] float32 natural-log LSE of this rank's part.
        group: the process group (default: the world; one rank when none is initialised).

    Returns:
        (o [..., H, D] in o's dtype, lse [..., H] float32; float64 if lse was), identical on
        every rank; with one rank, o and lse themselves.
    """
    import torch.distributed as dist

    from longctx.parallel.process_group import rank_and_world

    _check_pair(o, lse, "o", "lse")
    world = rank_and_world(group)[1]  # 1 without a process group, as in ring_attention
    if world == 1 or o.numel() == 0:  # nothing to merge (an empty state has no bytes to send)
        _check_values(None, lse, "lse")  # as merge_states would (CPU: free; CUDA: a sync, skipped)
        return o, lse
    # One collective for both tensors, packed per rank as bytes [lse | o], each part padded to
    # 8 bytes so every view stays aligned: at decode sizes a collective's latency (~10 µs in a
    # CUDA graph) far exceeds its transfer time.
    parts = [lse.contiguous().view(-1).view(torch.uint8), o.contiguous().view(-1).view(torch.uint8)]
    sizes = [p.numel() for p in parts]
    padded = [-(-n // 8) * 8 for n in sizes]
    pads = [parts[0].new_empty(p - n) for n, p in zip(sizes, padded)]
    send = torch.cat([parts[0], pads[0], parts[1], pads[1]])  # pads: never read
    recv = torch.empty(world, sum(padded), dtype=torch.uint8, device=o.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(recv.view(-1), send, group=group)
    lse_all = recv[:, :sizes[0]].view(lse.dtype).view(world, *lse.shape)  # strided views
    o_all = recv[:, padded[0]:padded[0] + sizes[1]].view(o.dtype).view(world, *o.shape)
    # Every rank checks every rank's lse (CPU tensors, as merge_states does), so a bad value
    # raises on all of them alike
    return merge_states(o_all, lse_all)
