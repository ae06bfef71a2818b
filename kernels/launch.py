"""Fast kernel launches: a compiled Triton kernel launched directly, from a per-signature cache.

Triton 3.6's `kernel[grid](...)` binds and specialises every argument on every call (dtype and
16-byte alignment of each pointer, range, `== 1` and `% 16` of each int, every constexpr, the
options), builds a cache key string and launch metadata, and only then launches: 20-60 µs of
host time per launch for the ~30 arguments of a decode kernel. An eager caller pays that on
every call; a CUDA graph does not.

A `Launch` is one kernel call whose arguments are fixed except a leading group of *dynamic*
ones: data pointers, and ints the kernel does not specialise on (`do_not_specialize`). The
wrappers in this package build a Launch once per input signature (shapes, strides, dtypes,
flags: everything its fixed arguments are computed from), keep it in their own cache, and call
it with the dynamic arguments only. The binary Triton would pick for a call is a function of the
fixed arguments (held by the Launch) and of the dynamic arguments' specialisation (`spec_code`:
each pointer's 16-byte alignment, each int's int32 / int64 / uint64 range); the Launch keeps one
binary per spec_code, asks Triton for it on that key's first call (`JITFunction.run(...,
warmup=True)` with pointer stand-ins: Triton's own rules decide, not a copy of them) and then
launches it with the CUDA launcher Triton generated for it.

Not covered, so the generic path runs instead (`fast_launch_active()` is False): the Triton
interpreter, a registered launch hook (`triton.knobs.runtime.launch_enter_hook` /
`launch_exit_hook`, e.g. a profiler) or pre-run hook, `LONGCTX_FAST_LAUNCH=0` in the
environment or inside `fast_launch(False)` (A/B timing, tests), and a Triton whose internals
differ from the ones used here (Triton 3.6's per-kernel C launcher or Triton 3.9's shared one;
`launch_internals_differ`, checked once, logged in one line). Triton's `debug` and
instrumentation knobs are read when a spec_code's binary is fetched, not per call.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Callable, Iterator, Sequence

import torch
import triton
from triton import knobs

from longctx.backend import interpreter_active
from longctx.kernels.utils import FP_FUSION, pdl_allowed

__all__ = ["Launch", "fast_launch", "fast_launch_active", "launch_internals_differ",
           "current_device", "pdl_allowed", "stream_scratch", "stream_counters",
           "spec_code", "signature", "remember", "MAX_PLANS"]

log = logging.getLogger(__name__)

_INTERPRET = interpreter_active()
_enabled = os.environ.get("LONGCTX_FAST_LAUNCH", "1") != "0"
# Per-signature caches (the callers' plan caches) are cleared when they reach this many entries:
# a bound on memory for callers whose shapes never repeat, far above any real working set.
MAX_PLANS = 4096


@contextlib.contextmanager
def fast_launch(enabled: bool = True) -> Iterator[None]:
    """Inside the block, launches take the fast path (True) or Triton's generic path (False)."""
    global _enabled
    prev, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = prev


def _hook_set(hook: object) -> bool:
    # Triton 3.6 keeps hooks in a HookChain (`.calls`); older code may assign a callable.
    return hook is not None and bool(getattr(hook, "calls", True))


# Triton 3.6: one C launcher generated per kernel (`make_launcher`), its arguments spread.
_CALL_36 = ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
# Triton 3.9: one C launcher for every kernel (`CudaUtils.launch`), told how to read the
# arguments (their annotations and C signature, made per kernel) and given them as one tuple.
_CALL_39 = ["self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata",
            "launch_metadata", "launch_enter_hook", "launch_exit_hook", "args"]
_LAUNCH_39 = ("self.launch(gridX,gridY,gridZ,stream,function,self.launch_cooperative_grid,"
              "self.launch_pdl,kernel_metadata,launch_metadata,launch_enter_hook,launch_exit_hook,"
              "global_scratch,profile_scratch,self.arg_annotations,self.kernel_signature,"
              "kernel_args)")


def launch_internals_differ() -> str | None:
    """None where this Triton has the internals the fast path calls, else what differs. They
    are: `JITFunction.run(..., warmup=True)` returning the compiled kernel; the launch hooks in
    `knobs.runtime`; and the CUDA launcher of one of two forms, the call `_direct_runner` makes
    in its place:
    - Triton 3.6: a C `launch` generated per kernel (`make_launcher`) taking grid, stream,
      function, flags, scratch, metadata, hooks and the kernel's arguments spread, as
      `CudaLauncher.__call__(gridX, gridY, gridZ, stream, function, *args)` passes them;
    - Triton 3.9: one C `launch` taking grid, stream, function, flags, metadata, hooks, scratch,
      the argument annotations and signature, and the kernel's arguments as a tuple, exactly as
      `CudaLauncher.__call__` (whose source is compared) calls it."""
    from triton.runtime.jit import JITFunction

    try:
        from triton.backends.nvidia import driver
    except ImportError as e:
        return f"no NVIDIA driver module ({e})"
    call = list(inspect.signature(driver.CudaLauncher.__call__).parameters)
    if call == _CALL_36:
        if not hasattr(driver, "make_launcher"):
            return "no per-kernel C launcher (triton.backends.nvidia.driver.make_launcher)"
    elif call == _CALL_39:
        try:
            source = "".join(inspect.getsource(driver.CudaLauncher.__call__).split())
        except (OSError, TypeError) as e:
            return f"CudaLauncher.__call__'s source is not readable ({e})"
        if _LAUNCH_39 not in source:
            return "CudaLauncher.__call__ calls its C launcher with other arguments"
    else:
        return f"CudaLauncher.__call__ takes {call}"
    if "warmup" not in inspect.signature(JITFunction.run).parameters:
        return "JITFunction.run takes no warmup"
    if not all(hasattr(knobs.runtime, h) for h in ("launch_enter_hook", "launch_exit_hook")):
        return "no launch hooks in triton.knobs.runtime"
    return None


_internals_ok: bool | None = None  # launch_internals_differ() is None; checked on first use


def _internals_match() -> bool:
    global _internals_ok
    if _internals_ok is None:
        why = launch_internals_differ()
        if why is not None:
            log.warning("longctx: Triton %s's launch internals differ from those the fast "
                        "launch path calls (%s); kernels launch through Triton's own path",
                        triton.__version__, why)
        _internals_ok = why is None
    return _internals_ok


def fast_launch_active() -> bool:
    """Whether launches may bypass Triton's launch path now: enabled, compiled kernels (not the
    interpreter), Triton's internals as expected (`launch_internals_differ`), and no launch hook
    registered (a hook gets Triton's launch metadata, which only the generic path builds)."""
    rt = knobs.runtime
    return _enabled and not _INTERPRET and _internals_match() and not (
        _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook))


def signature(x: object) -> object:
    """What input checks and plans read of an argument, for plan-cache keys: a tensor's device
    index, dtype, shape and strides; anything else's type (None, an int offset whose value is a
    launch argument)."""
    if isinstance(x, torch.Tensor):
        return (x.get_device(), x.dtype, x.shape, x.stride())
    return type(x)


def remember(plans: dict, key: tuple, plan: object) -> None:
    """plans[key] = plan, emptying `plans` first once it holds MAX_PLANS."""
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = plan


def current_device() -> int:
    """Index of the current CUDA device: where Triton compiles and launches (it does not look at
    the tensors' devices), so the device every plan cache is keyed by."""
    return torch._C._cuda_getDevice()


def _stream(device: int) -> int:
    """The current CUDA stream of `device`, as Triton's launches take it."""
    return torch._C._cuda_getCurrentRawStream(device)


# Per-stream scratch buffers: (device, stream, slot) -> uint8 tensor.
_scratch: dict[tuple[int, int, str], torch.Tensor] = {}


def stream_scratch(nbytes: int, device: int, slot: str, stream: int | None = None) -> torch.Tensor:
    """A uint8 buffer of at least `nbytes` on CUDA device `device` for work queued on `stream`
    (default: the device's current stream), reused by every later call with the same slot on
    that stream: an allocation costs ~3.5 µs of host time per eager call (H200, torch 2.11), more
    than the rest of a decode call's Python.

    Safe because the buffer is private to one stream: the kernels that read it are queued before
    any later launch that writes it, and kernels launched with PDL write nothing before their
    `pdl_wait`, which returns once the kernel before them has completed. (The caching allocator
    relies on the same stream order when it hands a freed block to the next allocation on that
    stream.) While the current stream is capturing a CUDA graph it allocates instead, so that
    every graph owns its buffers and two graphs replayed concurrently never share one: callers
    must then hold the returned tensor until their launches are queued, as for any temporary.
    """
    if _capturing():
        return torch.empty(nbytes, dtype=torch.uint8, device=_scratch_device(device))
    key = (device, _stream(device) if stream is None else stream, slot)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < nbytes:
        # Grown geometrically; the old buffer goes back to the caching allocator, which reuses it
        # for this stream only after the work queued so far (stream order again).
        size = max(nbytes, 2 * buf.numel() if buf is not None else 0, 1 << 16)
        buf = _scratch[key] = torch.empty(size, dtype=torch.uint8, device=_scratch_device(device))
    return buf


# Zeroed int32 counters: (device, stream) -> tensor, and per device the capture pool
# [tensor, ints handed out].
_counters: dict[tuple[int, int], torch.Tensor] = {}
_capture_pool: dict[int, list] = {}
_CAPTURE_POOL_INTS = 1 << 16


def stream_counters(n: int, device: int) -> torch.Tensor:
    """n int32 zeros on CUDA device `device` for a kernel that counts arrivals in them and
    leaves them zero again when it completes (the decode kernel's fused merge): reused by every
    later launch on the device's current stream, which stream order keeps from overlapping.

    While the current stream is capturing a CUDA graph every call gets counters of its own, so
    that graphs replayed concurrently never share them: a slice, never handed out again, of a
    zeroed pool made outside any capture (graph replays leave it zero as every launch does),
    or, with the pool used up or not yet made, a graph-owned buffer zeroed by a memset in the
    graph. Hold the tensor until the launch is queued.
    """
    if _capturing():
        pool = _capture_pool.get(device)
        if pool is None or pool[1] + n > pool[0].numel():
            return torch.zeros(n, dtype=torch.int32, device=_scratch_device(device))
        start = pool[1]
        pool[1] += -(-n // 32) * 32  # 128-byte aligned slices
        return pool[0][start:start + n]
    key = (device, _stream(device))
    buf = _counters.get(key)
    if buf is None or buf.numel() < n:
        # The old buffer goes back to the caching allocator as stream_scratch's does.
        size = max(n, 2 * buf.numel() if buf is not None else 0, 1024)
        buf = _counters[key] = torch.zeros(size, dtype=torch.int32, device=_scratch_device(device))
        if device not in _capture_pool:
            _capture_pool[device] = [torch.zeros(_CAPTURE_POOL_INTS, dtype=torch.int32,
                                                 device=_scratch_device(device)), 0]
    return buf


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (tests on CPU replace it)."""
    return torch._C._cuda_isCurrentStreamCapturing()


def _scratch_device(device: int) -> torch.device:
    """Where `stream_scratch` allocates (tests on CPU replace it)."""
    return torch.device("cuda", device)


class _Pointer:
    """A data pointer as Triton's specialisation sees a tensor: `data_ptr()` and `dtype`."""

    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype) -> None:
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


def _int_code(x: int) -> int:
    """Triton's type of an unspecialised int argument: 0 int32, 1 int64, 2 uint64 (as
    native_specialize_impl: by range; tests/test_fast_launch.py checks it against Triton)."""
    if -(1 << 31) <= x < (1 << 31):
        return 0
    if -(1 << 63) <= x < (1 << 63):
        return 1
    if 0 <= x < (1 << 64):
        return 2
    raise ValueError(f"integer argument {x} does not fit in 64 bits")


def spec_code(dyn: Sequence, dyn_dtypes: Sequence[torch.dtype | None]) -> int:
    """The part of Triton's specialisation that varies between calls of one Launch, as an int:
    2 bits per dynamic argument (pointer: 1 if not 16-byte aligned; int: `_int_code`). 0 when
    every pointer is aligned and every int fits int32 (the common case)."""
    code = 0
    for i, (x, dt) in enumerate(zip(dyn, dyn_dtypes)):
        c = (1 if x & 15 else 0) if dt is not None else _int_code(x)
        code |= c << (2 * i)
    return code


def _direct_runner(ck, grid: tuple[int, int, int]) -> Callable[[int, tuple], None]:
    """launch(stream, args) for compiled kernel `ck`: straight into the C launcher Triton calls
    for it where that is the CUDA launcher (either form of `launch_internals_differ`), else
    through the launcher object as Triton calls it. A kernel that needs global scratch (TMA
    descriptors made on the device) gets the same bytes Triton's launcher would ask its allocator
    for, from the launch stream's `stream_scratch`."""
    launcher = ck.run  # first access loads the module into the current device's context
    g0, g1, g2 = grid
    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except ImportError:  # another backend: its launcher object, called as Triton calls it
        CudaLauncher = None
    if (CudaLauncher is not None and type(launcher) is CudaLauncher
            and not launcher.profile_scratch_size and not getattr(launcher, "gsan_enabled", 0)):
        c_launch = launcher.launch
        flags = (ck.function, launcher.launch_cooperative_grid, launcher.launch_pdl)
        # packed metadata, launch metadata, enter / exit hooks
        meta = (ck.packed_metadata, None, None, None)
        nbytes = g0 * g1 * g2 * launcher.num_ctas * launcher.global_scratch_size
        if hasattr(launcher, "kernel_signature"):  # Triton 3.9: arguments as one tuple
            sig = (launcher.arg_annotations, launcher.kernel_signature)
            if nbytes:
                def run(stream: int, args: tuple) -> None:
                    scratch = stream_scratch(nbytes, torch._C._cuda_getDevice(), "tma", stream)
                    c_launch(g0, g1, g2, stream, *flags, *meta, scratch, None, *sig, args)
            else:
                head = flags + meta + (None, None) + sig

                def run(stream: int, args: tuple) -> None:
                    c_launch(g0, g1, g2, stream, *head, args)
        elif nbytes:  # Triton 3.6: scratch buffers before the metadata, arguments spread
            def run(stream: int, args: tuple) -> None:
                scratch = stream_scratch(nbytes, torch._C._cuda_getDevice(), "tma", stream)
                c_launch(g0, g1, g2, stream, *flags, scratch, None, *meta, *args)
        else:
            head = flags + (None, None) + meta

            def run(stream: int, args: tuple) -> None:
                c_launch(g0, g1, g2, stream, *head, *args)
    else:
        mid = (ck.function, ck.packed_metadata, None, None, None)

        def run(stream: int, args: tuple) -> None:
            launcher(g0, g1, g2, stream, *mid, *args)
    run.binary = ck  # for tests: the CompiledKernel this launches
    return run


_signatures: dict = {}


def _signature(fn) -> tuple[inspect.Signature, tuple[str, ...], frozenset[str]]:
    """(signature, parameter names, names in do_not_specialize) of a @triton.jit kernel, compiled
    (JITFunction) or interpreted (InterpretedFunction); cached per kernel."""
    info = _signatures.get(fn)
    if info is None:
        sig = inspect.signature(fn.fn)
        names = tuple(sig.parameters)
        if hasattr(fn, "params"):  # JITFunction
            dns = frozenset(p.name for p in fn.params if p.do_not_specialize)
        else:  # the interpreter keeps @triton.jit's keyword arguments
            given = getattr(fn, "kwargs", {}).get("do_not_specialize") or ()
            dns = frozenset(names[x] if isinstance(x, int) else x for x in given)
        info = _signatures[fn] = (sig, names, dns)
    return info


def triton_binary(stand_ins: tuple, launch: "Launch") -> Callable[[int, tuple], None] | None:
    """The launcher of the binary Triton picks for these arguments (compiled on first use), or
    None where Triton declines (a jit_cache_hook that skips compilation)."""
    ck = launch.fn.run(*stand_ins, *launch.tail, grid=launch.grid, warmup=True, **launch.kwargs)
    if ck is not None and hasattr(ck, "result"):  # Triton's async compile mode
        ck = ck.result()
    return None if ck is None else _direct_runner(ck, launch.grid)


# How a Launch gets the launcher of a binary; tests replace it (tests/test_fast_launch.py).
_fetch_binary = triton_binary


class Launch:
    """One kernel call with fixed arguments, launched fast (`__call__`) or generically (`generic`).

    Args:
        fn: the @triton.jit kernel.
        grid: its launch grid (1 to 3 ints).
        dyn_dtypes: one entry per leading dynamic argument: the pointee dtype for a pointer (a
            tensor on the generic path, its data_ptr() on the fast path), None for an int, which
            the kernel must list in do_not_specialize.
        tail: the positional arguments after the dynamic ones.
        kwargs: constexprs by name and launch options (num_warps, num_stages, launch_pdl, ...;
            `FP_FUSION` unless said otherwise).
    """

    __slots__ = ("fn", "grid", "dyn_dtypes", "tail", "kwargs", "_suffix", "_binaries",
                 "_has_ints")

    def __init__(self, fn, grid: Sequence[int], dyn_dtypes: Sequence[torch.dtype | None],
                 tail: Sequence, kwargs: dict) -> None:
        self.fn, self.dyn_dtypes, self.tail = fn, tuple(dyn_dtypes), tuple(tail)
        self.kwargs = {**FP_FUSION, **kwargs}
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        _, names, unspecialized = _signature(fn)
        for name, dt in zip(names, self.dyn_dtypes):
            if dt is None and name not in unspecialized:
                raise ValueError(f"dynamic int argument {name} of {fn} must be in "
                                 "do_not_specialize (its value would select the binary)")
        self._suffix: tuple | None = None
        self._binaries: dict[int, Callable[[int, tuple], None] | None] = {}
        self._has_ints = None in self.dyn_dtypes

    @property
    def suffix(self) -> tuple:
        """Every argument after the dynamic ones, in the kernel's parameter order, defaults
        included: what Triton passes its launcher (constexprs too; the launcher skips them)."""
        if self._suffix is None:
            sig, names, _ = _signature(self.fn)
            bound = sig.bind(*([None] * len(self.dyn_dtypes)), *self.tail,
                             **{k: v for k, v in self.kwargs.items() if k in sig.parameters})
            bound.apply_defaults()
            self._suffix = tuple(bound.arguments[p] for p in names[len(self.dyn_dtypes):])
        return self._suffix

    def generic(self, *dyn) -> None:
        """Launch through Triton's `kernel[grid](...)` (dynamic pointers given as tensors, or
        as ints wrapped in stand-ins by `__call__`)."""
        self.fn[self.grid](*dyn, *self.tail, **self.kwargs)

    def stand_ins(self, dyn: tuple) -> tuple:
        """The dynamic arguments as Triton's specialisation sees tensors (pointers wrapped)."""
        return tuple(x if dt is None else _Pointer(x, dt) for x, dt in zip(dyn, self.dyn_dtypes))

    def spec_code(self, dyn: tuple) -> int:
        """`spec_code` of these dynamic arguments; the common case (every pointer aligned, every
        int within int32) returns 0 without building the code."""
        if self._has_ints:
            for x, dt in zip(dyn, self.dyn_dtypes):
                if (x & 15) if dt is not None else not -2147483648 <= x <= 2147483647:
                    return spec_code(dyn, self.dyn_dtypes)
        else:
            for x in dyn:
                if x & 15:
                    return spec_code(dyn, self.dyn_dtypes)
        return 0

    def __call__(self, dyn: tuple, device: int) -> None:
        """Launch on the current stream of CUDA device `device` (the current device), dynamic
        pointers given as ints (data_ptr()), ints as ints."""
        code = self.spec_code(dyn)
        try:
            run = self._binaries[code]
        except KeyError:
            run = self._binaries[code] = _fetch_binary(self.stand_ins(dyn), self)
        if run is None or self.fn.pre_run_hooks:  # Triton runs pre-run hooks: its path, then
            self.generic(*self.stand_ins(dyn))
            return
        run(_stream(device), dyn + self.suffix)
