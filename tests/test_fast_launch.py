"""The fast launch path (longctx.kernels.launch and the public entry points' plan caches), on CPU.

Under the Triton interpreter there is no compiled binary, so these tests stand in for it: the
`interp_fast` fixture makes `fast_launch_active()` true and replaces the binary fetch by a
launcher that runs the kernel in the interpreter from exactly the argument tuple the fast path
hands the C launcher (data pointers as ints, turned back into tensors at those addresses). So the
public calls run their fast path end to end on a CPU: cache keys, plans, pointer arithmetic into
scratch buffers, argument order. Against Triton itself: the specialisation code is checked
against Triton's native specialisation, and the fast argument tuple against Triton's own binding.
tests/test_fast_launch_gpu.py runs the compiled path.
"""

import ctypes
import importlib
import inspect

import pytest
import torch
from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

import longctx
from longctx.backend import force_triton
from longctx.kernels import decode as kernels_decode, launch as L
from longctx.kernels.merge import _merge_kernel
from longctx.kernels.prefill import _attn_fwd_kernel

# The modules (longctx re-exports their functions under the same names).
api_attention = importlib.import_module("longctx.attention")
api_decode = importlib.import_module("longctx.decode")
api_merge = importlib.import_module("longctx.merge")

F64 = torch.float64
_BACKEND = type(make_backend(GPUTarget("cuda", 90, 32)))


def _clear_plans():
    for d in (api_decode._PLANS, api_attention._PLANS, api_attention._MERGE_PLANS,
              api_merge._STATES_PLANS, api_merge._INTO_PLANS):
        d.clear()


def _as_tensor(ptr: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose data pointer is `ptr` (CPU memory owned by a live tensor): the kernel's
    offsets from it stay inside that tensor, the interpreter only needs the base address."""
    return torch.frombuffer((ctypes.c_byte * 16).from_address(ptr), dtype=dtype)


class _Recorder:
    """Binary fetches and launches seen by the fast path."""

    def __init__(self):
        self.fetches: list[tuple[str, int]] = []
        self.launches: list[tuple[str, tuple]] = []

    def fetch(self, stand_ins: tuple, launch: L.Launch):
        code = L.spec_code(tuple(x.ptr if isinstance(x, L._Pointer) else x for x in stand_ins),
                           launch.dyn_dtypes)
        self.fetches.append((launch.fn.__name__, code))

        def run(stream: int, args: tuple) -> None:
            n = len(launch.dyn_dtypes)
            assert len(args) == len(L._signature(launch.fn)[1]), "one argument per kernel parameter"
            self.launches.append((launch.fn.__name__, args))
            dyn = [x if dt is None else _as_tensor(x, dt) for x, dt in zip(args[:n], launch.dyn_dtypes)]
            launch.fn[launch.grid](*dyn, *args[n:])  # all positional, as the C launcher gets them
        return run


@pytest.fixture
def interp_fast(monkeypatch):
    """The public entry points take their fast path on CPU tensors (kernels in the interpreter)."""
    rec = _Recorder()
    monkeypatch.setattr(L, "_INTERPRET", False)
    monkeypatch.setattr(L, "_internals_ok", True)  # the recorder below stands in for them
    monkeypatch.setattr(L, "current_device", lambda: 0)
    monkeypatch.setattr(L, "_stream", lambda device: 0)
    monkeypatch.setattr(L, "_capturing", lambda: False)
    monkeypatch.setattr(L, "_scratch_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(L, "_scratch", {})
    monkeypatch.setattr(L, "_counters", {})
    monkeypatch.setattr(L, "_capture_pool", {})
    monkeypatch.setattr(L, "_fetch_binary", rec.fetch)
    _clear_plans()
    with force_triton():
        yield rec
    _clear_plans()


def _generic(fn, *args, **kw):
    """The same call on Triton's generic path (the interpreter's launch), no plan cache."""
    with L.fast_launch(False), force_triton():
        return fn(*args, **kw)


def _same(a, b):
    if isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), f"max diff {(a.to(F64) - b.to(F64)).abs().max().item()}"


# --------------------------------------------------------------------------- spec_code vs Triton
def _triton_spec(x, dtype):
    if dtype is None:  # a do_not_specialize int
        return native_specialize_impl(_BACKEND, x, False, False, True)
    return native_specialize_impl(_BACKEND, L._Pointer(x, dtype), False, True, True)


@pytest.mark.parametrize("dtype", [None, torch.float16, torch.int32])
def test_spec_code_partitions_like_triton(dtype):
    """Two dynamic arguments get the same code iff Triton specialises them the same way."""
    if dtype is None:
        values = [0, 1, 17, (1 << 31) - 1, 1 << 31, -(1 << 31), -(1 << 31) - 1, (1 << 63) - 1,
                  1 << 63, (1 << 64) - 1, -(1 << 63)]
    else:
        values = [0, 16, 1 << 40, 2, 8, (1 << 40) + 4, 4096 + 15]
    for a in values:
        for b in values:
            same_code = L.spec_code((a,), (dtype,)) == L.spec_code((b,), (dtype,))
            assert same_code == (_triton_spec(a, dtype) == _triton_spec(b, dtype)), (a, b)
    assert L.spec_code((16, 32), (dtype, dtype)) == 0 or dtype is None


def test_spec_code_of_several_arguments_is_per_argument():
    dts = (torch.float16, torch.float16, None)
    codes = {L.spec_code((a, b, c), dts) for a in (0, 2) for b in (0, 2) for c in (0, 1 << 40)}
    assert len(codes) == 8


def test_dynamic_int_must_be_unspecialized():
    with pytest.raises(ValueError, match="do_not_specialize"):
        L.Launch(_merge_kernel, (1,), (torch.float32, torch.float32, torch.float32, None), (), {})
    L.Launch(_attn_fwd_kernel, (1,), (torch.float16,) * 5 + (None, None), (), {})  # Q/K_START: fine


# ----------------------------------------------------- the fast argument tuple vs Triton's binding
def _triton_bound(launch: L.Launch, dyn: tuple):
    """What Triton's generic path would pass its launcher, and its specialisation, for these
    dynamic arguments (Triton's binder, built for a CUDA target; no GPU needed)."""
    jit = JITFunction(launch.fn.fn, do_not_specialize=sorted(L._signature(launch.fn)[2]))
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, spec, _ = binder(*launch.stand_ins(dyn), *launch.tail, **launch.kwargs)
    return tuple(bound.values()), spec


@pytest.mark.interpreter
def test_fast_arguments_are_tritons_bound_arguments(interp_fast, monkeypatch):
    """For every kernel the public calls launch: the tuple the fast path passes the launcher is
    Triton's bound argument list, and calls with equal plan key and spec_code specialise the same."""
    q = torch.randn(3, 1, 6, 16)
    kc, vc = torch.randn(3, 40, 2, 16), torch.randn(3, 40, 2, 16)
    lens = torch.tensor([40, 3, 0], dtype=torch.int32)
    longctx.decode(q, kc, vc, cache_seqlens=lens, num_splits=3)  # the merge fused
    monkeypatch.setattr(kernels_decode, "DECODE_MERGE", "separate")
    longctx.decode(q, kc, vc, cache_seqlens=lens, num_splits=2)  # split and merge kernels
    longctx.merge_states(torch.randn(3, 2, 4, 16), torch.randn(3, 2, 4))
    longctx.merge_into(torch.zeros(2, 4, 16), torch.full((2, 4), float("-inf")),
                       torch.randn(2, 4, 16), torch.randn(2, 4))
    qa, ka = torch.randn(2, 5, 4, 16), torch.randn(2, 7, 2, 16)
    longctx.attention(qa, ka, ka, causal=True, q_start=3)
    longctx.attention(qa, ka, ka, causal=True, q_start=torch.tensor([3, 1]), k_start=1 << 33)
    kernels = {name for name, _ in interp_fast.launches}
    assert kernels == {"_decode_split_kernel", "_merge_kernel", "_merge_into_kernel",
                       "_attn_fwd_kernel"}
    plans = [*api_decode._PLANS.values(), *api_merge._STATES_PLANS.values(),
             *api_merge._INTO_PLANS.values(), *api_attention._PLANS.values()]
    launches = [lz for p in plans for lz in (getattr(p, "split", None), getattr(p, "merge", None),
                                             getattr(p, "launch", None)) if lz is not None]
    assert len(launches) == 7
    for launch in launches:
        name = launch.fn.__name__
        n_dyn = len(launch.dyn_dtypes)
        seen = [a for n, a in interp_fast.launches if n == name and a[n_dyn:] == launch.suffix]
        assert seen, name
        args = seen[0]
        dyn = args[:n_dyn]
        bound, spec = _triton_bound(launch, dyn)
        assert len(bound) == len(args)
        for got, want in zip(args, bound):
            assert got == (want.ptr if isinstance(want, L._Pointer) else want)
        # Other data pointers with the same alignment (and offsets of the same int range):
        # the same specialisation, so the same binary.
        other = tuple(x if dt is None else x + 4096 for x, dt in zip(dyn, launch.dyn_dtypes))
        assert L.spec_code(other, launch.dyn_dtypes) == L.spec_code(dyn, launch.dyn_dtypes)
        assert _triton_bound(launch, other)[1] == spec


# ----------------------------------------------------------------- fast == generic, end to end
def _paged(k, v, page):
    B, S = k.shape[:2]
    n = B * (S // page)
    perm = torch.randperm(n + 2)[:n]
    kp = torch.randn(n + 2, page, *k.shape[2:], dtype=k.dtype)
    vp = torch.randn_like(kp)
    kp[perm] = k.reshape(n, page, *k.shape[2:])
    vp[perm] = v.reshape(n, page, *v.shape[2:])
    return kp, vp, perm.view(B, S // page).to(torch.int32)


@pytest.mark.interpreter
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("lengths", [[40, 0, 17], None])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("merge", ["fused", "separate"])
def test_decode_fast_matches_generic(interp_fast, monkeypatch, paged, lengths, num_splits,
                                     return_lse, merge):
    monkeypatch.setattr(kernels_decode, "DECODE_MERGE", merge)
    B, S, Hq, Hkv, D = 3, 48, 6, 2, 16  # GQA group 3
    q = torch.randn(B, Hq, D, dtype=torch.float16)
    k, v = torch.randn(B, S, Hkv, D, dtype=torch.float16), torch.randn(B, S, Hkv, D, dtype=torch.float16)
    lens = None if lengths is None else torch.tensor(lengths, dtype=torch.int32)
    kw = dict(cache_seqlens=lens, num_splits=num_splits, return_lse=return_lse)
    if paged:
        k, v, kw["block_table"] = _paged(k, v, 16)
    fast = longctx.decode(q, k, v, **kw)
    again = longctx.decode(q, k, v, **kw)
    _same(fast, _generic(longctx.decode, q, k, v, **kw))
    _same(again, fast)
    assert len(api_decode._PLANS) == 1
    n_kernels = 1 if num_splits == 1 or merge == "fused" else 2
    assert len(interp_fast.fetches) == n_kernels and len(interp_fast.launches) == 2 * n_kernels


@pytest.mark.interpreter
def test_decode_fast_matches_reference_with_4d_q_and_full_default(interp_fast):
    B, S, Hq, Hkv, D = 2, 33, 4, 1, 16
    q = torch.randn(B, 1, Hq, D)
    k, v = torch.randn(B, S, Hkv, D), torch.randn(B, S, Hkv, D)
    o, lse = longctx.decode(q, k, v, num_splits=4, return_lse=True)
    ro, rlse = longctx.reference_attention(q.to(F64), k.to(F64), v.to(F64))
    assert o.shape == q.shape and lse.shape == q.shape[:-1]  # lse: o without head_dim
    torch.testing.assert_close(o.to(F64), ro, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.to(F64), rlse, rtol=0, atol=1e-5)
    full = torch.full((B,), S, dtype=torch.int32)  # the default is the capacity
    _same((o, lse), longctx.decode(q, k, v, cache_seqlens=full, num_splits=4, return_lse=True))


@pytest.mark.interpreter
def test_decode_changed_signature_takes_a_new_plan(interp_fast):
    """Only one thing changes per call (stride, dtype, shape, alignment): a new plan or binary
    each time, and every output equals the generic path's."""
    B, S, Hq, Hkv, D = 2, 32, 4, 2, 16
    q = torch.randn(B, Hq, D, dtype=torch.float16)
    big = torch.randn(B, S, 2 * Hkv, D, dtype=torch.float16)
    k = big[:, :, :Hkv].contiguous()
    v = torch.randn_like(k)
    lens = torch.tensor([32, 9], dtype=torch.int32)
    calls = [
        (q, k, v),
        (q, big[:, :, Hkv:], v),                       # k: other strides, same shape
        (q.float(), k.float(), v.float()),             # dtype
        (q[:1], k[:1], v[:1]),                         # shape (batch)
    ]
    for i, (qq, kk, vv) in enumerate(calls):
        ll = lens[:qq.shape[0]]
        _same(longctx.decode(qq, kk, vv, cache_seqlens=ll, num_splits=2),
              _generic(longctx.decode, qq, kk, vv, cache_seqlens=ll, num_splits=2))
        assert len(api_decode._PLANS) == i + 1
    # Same signature, data pointer no longer 16-byte aligned: same plan, another binary.
    qbuf = torch.randn(B * Hq * D + 1, dtype=torch.float16)
    q_odd = qbuf[1:].view(B, Hq, D)
    assert q_odd.data_ptr() % 16 and q_odd.stride() == q.stride()
    fetched = len(interp_fast.fetches)
    _same(longctx.decode(q_odd, k, v, cache_seqlens=lens, num_splits=2),
          _generic(longctx.decode, q_odd, k, v, cache_seqlens=lens, num_splits=2))
    assert len(api_decode._PLANS) == 4
    codes = [c for name, c in interp_fast.fetches[fetched:] if name == "_decode_split_kernel"]
    assert codes == [1]  # q (argument 0) unaligned


@pytest.mark.interpreter
def test_decode_fast_path_still_validates(interp_fast):
    q = torch.randn(2, 4, 16)
    k = torch.randn(2, 8, 2, 16)
    with pytest.raises(ValueError, match="k_cache has dtype"):
        longctx.decode(q, k.half(), k.half())
    with pytest.raises(ValueError, match="cache_seqlens must be an int32"):
        longctx.decode(q, k, k, cache_seqlens=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="softmax_scale"):
        longctx.decode(q, k, k, softmax_scale=[1.0])  # unhashable: no key, validation raises
    with pytest.raises(ValueError, match="block_table must have unit stride"):
        longctx.decode(q, torch.randn(8, 16, 2, 16), torch.randn(8, 16, 2, 16),
                       block_table=torch.zeros(4, 2, dtype=torch.int32).t())
    assert not api_decode._PLANS and not interp_fast.fetches


@pytest.mark.interpreter
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("offsets", ["int", "tensor", "huge"])
def test_attention_fast_matches_generic(interp_fast, causal, offsets):
    q = torch.randn(2, 37, 4, 16, dtype=torch.float16)
    k, v = torch.randn(2, 45, 2, 16, dtype=torch.float16), torch.randn(2, 45, 2, 16, dtype=torch.float16)
    qs, ks = {"int": (20, 0), "tensor": (torch.tensor([20, 3]), torch.tensor([0, 5], dtype=torch.int32)),
              "huge": ((1 << 33) + 20, 1 << 33)}[offsets]
    kw = dict(causal=causal, q_start=qs, k_start=ks, return_lse=True)
    fast = longctx.attention(q, k, v, **kw)
    _same(fast, _generic(longctx.attention, q, k, v, **kw))
    _same(longctx.attention(q, k, v, **kw), fast)
    assert len(api_attention._PLANS) == 1 and len(interp_fast.fetches) == 1


@pytest.mark.interpreter
def test_attention_int_offsets_of_other_range_take_another_binary(interp_fast):
    q = torch.randn(1, 20, 2, 16, dtype=torch.float16)
    k = torch.randn(1, 20, 2, 16, dtype=torch.float16)
    for qs in (5, 7, (1 << 31) + 5):
        _same(longctx.attention(q, k, k, causal=True, q_start=qs, k_start=qs - 5),
              _generic(longctx.attention, q, k, k, causal=True, q_start=qs, k_start=qs - 5))
    assert len(api_attention._PLANS) == 1
    assert [c for _, c in interp_fast.fetches] == [0, (1 << 10) | (1 << 12)]  # Q/K_START int64


@pytest.mark.interpreter
def test_attention_varlen_and_merge_into_fast_match_generic(interp_fast):
    lens_q, lens_k = [3, 0, 20], [5, 1, 20]
    q = torch.randn(sum(lens_q), 4, 16)
    k, v = torch.randn(sum(lens_k), 2, 16), torch.randn(sum(lens_k), 2, 16)
    cu_q = torch.tensor([0, 3, 3, 23], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 6, 26], dtype=torch.int32)
    kw = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=20, max_seqlen_k=20,
              q_start=torch.tensor([2, 0, 0]), return_lse=True)
    _same(longctx.attention(q, k, v, **kw), _generic(longctx.attention, q, k, v, **kw))

    qd, kd = torch.randn(2, 9, 4, 16), torch.randn(2, 11, 2, 16)
    acc = [(torch.randn(2, 9, 4, 16), torch.randn(2, 9, 4)) for _ in range(2)]
    acc[1] = (acc[0][0].clone(), acc[0][1].clone())
    longctx.attention_merge_into(*acc[0], qd, kd, kd, causal=True, q_start=2)
    _generic(longctx.attention_merge_into, *acc[1], qd, kd, kd, causal=True, q_start=2)
    _same(acc[0], acc[1])
    assert len(api_attention._MERGE_PLANS) == 1


@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_merge_fast_matches_generic(interp_fast, layout):
    o = torch.randn(5, 3, 4, 16)
    lse = torch.randn(5, 3, 4)
    lse[1] = float("-inf")
    if layout == "strided":  # views reshape cannot flatten: copied per call
        o = torch.randn(5, 4, 3, 16).transpose(1, 2)
        lse = torch.randn(5, 4, 3).transpose(1, 2)
    _same(longctx.merge_states(o, lse), _generic(longctx.merge_states, o, lse))
    acc = [(torch.randn(3, 4, 16), torch.randn(3, 4)) for _ in range(2)]
    acc[1] = (acc[0][0].clone(), acc[0][1].clone())
    longctx.merge_into(*acc[0], o[0], lse[0])
    _generic(longctx.merge_into, *acc[1], o[0], lse[0])
    _same(acc[0], acc[1])


@pytest.mark.interpreter
def test_merge_checks_values_only_where_free(interp_fast):
    o, lse = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 4)
    lse[0, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="lse"):  # CPU tensors: checked by default
        longctx.merge_states(o, lse)
    longctx.merge_states(o, lse, check=False)


# ----------------------------------------------------------------------- switches and bounds
@pytest.mark.interpreter
def test_fast_launch_switches(interp_fast):
    q = torch.randn(1, 2, 16)
    k = torch.randn(1, 8, 1, 16)
    with L.fast_launch(False):
        assert not L.fast_launch_active()
        longctx.decode(q, k, k, num_splits=1)
    assert not interp_fast.fetches and not api_decode._PLANS
    assert L.fast_launch_active()
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert not L.fast_launch_active()  # a profiler's hook sees every launch: generic path
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert L.fast_launch_active()


@pytest.mark.interpreter
def test_plan_cache_is_bounded(interp_fast, monkeypatch):
    monkeypatch.setattr(L, "MAX_PLANS", 3)
    k = torch.randn(1, 8, 1, 16)
    for b in range(5):
        longctx.decode(torch.randn(1, 2, 16), k, k, num_splits=1, softmax_scale=0.1 + b)
        assert len(api_decode._PLANS) == b % 3 + 1


def test_launch_internals_are_checked_once_and_a_difference_logged_once(monkeypatch, caplog):
    """Where Triton's internals differ, every launch takes Triton's own path, said in one line."""
    monkeypatch.setattr(L, "_INTERPRET", False)
    monkeypatch.setattr(L, "_internals_ok", None)
    calls = []
    monkeypatch.setattr(L, "launch_internals_differ", lambda: calls.append(1) or "no such launcher")
    with caplog.at_level("WARNING", logger=L.__name__):
        assert not L.fast_launch_active() and not L.fast_launch_active()
    assert len(calls) == 1
    (record,) = caplog.records
    assert "no such launcher" in record.getMessage() and "Triton's own path" in record.getMessage()


def test_launch_internals_of_the_installed_triton():
    """The fast path knows both launcher forms: Triton 3.6's per-kernel C launcher and Triton
    3.9's shared one (CI runs this on each)."""
    assert L.launch_internals_differ() is None


@pytest.mark.parametrize("scratch", [0, 96])
def test_direct_runner_calls_the_c_launcher_as_triton_does(monkeypatch, scratch):
    """The direct runner hands the installed Triton's C launcher the same arguments that
    Triton's own `CudaLauncher.__call__` hands it for the same launch, with and without global
    scratch (on CPU: a launcher object with a recording `launch` and no CUDA behind it)."""
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime import _allocation
    from triton.runtime import driver as triton_driver

    calls = []
    launcher = object.__new__(CudaLauncher)
    launcher.launch = lambda *a: calls.append(a)
    launcher.launch_cooperative_grid, launcher.launch_pdl, launcher.num_ctas = False, True, 2
    launcher.global_scratch_size, launcher.global_scratch_align = scratch, 128
    launcher.profile_scratch_size, launcher.profile_scratch_align = 0, 1
    if list(inspect.signature(CudaLauncher.__call__).parameters) == L._CALL_39:
        launcher.arg_annotations, launcher.kernel_signature = ["annotations"], b"\x01\x02"
        launcher.gsan_enabled = False
        monkeypatch.setattr(triton_driver, "_active", object())  # read, unused: no CUDA here
    buffer = object()
    sizes = []

    class Allocator:  # Triton's scratch allocator, as `triton.set_allocator` installs one
        @staticmethod
        def get():
            return lambda size, align, stream: sizes.append(size) or buffer

    monkeypatch.setattr(_allocation, "_allocator", Allocator)
    monkeypatch.setattr(L, "stream_scratch",
                        lambda n, device, slot, stream: sizes.append(n) or buffer)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    ck = type("Compiled", (), {"run": launcher, "function": 1234, "packed_metadata": (4, 2, 0)})
    args = (0x7F0000001000, 17, None, 3.5)
    L._direct_runner(ck, (3, 2, 1))(77, args)
    CudaLauncher.__call__(launcher, 3, 2, 1, 77, 1234, (4, 2, 0), None, None, None, *args)
    ours, tritons = calls
    assert ours == tritons
    assert sizes == ([3 * 2 * 2 * scratch] * 2 if scratch else [])


def test_stream_counters_reuse_growth_and_capture(monkeypatch):
    """stream_counters: zeros, one buffer per (device, stream) reused while large enough; while a
    graph is captured, slices of the zeroed pool never handed out twice, then graph-owned zeros
    once the pool is used up."""
    monkeypatch.setattr(L, "_counters", {})
    monkeypatch.setattr(L, "_capture_pool", {})
    monkeypatch.setattr(L, "_CAPTURE_POOL_INTS", 160)
    monkeypatch.setattr(L, "_scratch_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(L, "_capturing", lambda: False)
    stream = [7]
    monkeypatch.setattr(L, "_stream", lambda device: stream[0])
    a = L.stream_counters(10, 0)
    assert a.dtype == torch.int32 and a.numel() >= 10 and not a.any()
    assert L.stream_counters(10, 0) is a
    stream[0] = 8
    assert L.stream_counters(10, 0) is not a
    stream[0] = 7
    big = L.stream_counters(a.numel() + 1, 0)
    assert big is not a and big.numel() > a.numel() and not big.any()
    monkeypatch.setattr(L, "_capturing", lambda: True)
    pool = L._capture_pool[0][0]
    c1, c2 = L.stream_counters(40, 0), L.stream_counters(40, 0)
    assert c1.numel() == c2.numel() == 40 and not c1.any() and not c2.any()
    assert c1.data_ptr() == pool.data_ptr() and c2.data_ptr() >= c1.data_ptr() + 4 * 40
    c3 = L.stream_counters(40, 0)  # 128 + 40 ints would not fit in 160: the pool is used up
    assert c3.untyped_storage().data_ptr() != pool.untyped_storage().data_ptr() and not c3.any()


def test_stream_scratch_reuse_growth_and_capture(monkeypatch):
    """stream_scratch: one buffer per (device, stream, slot), reused while large enough, grown
    when not; while a graph is captured, a fresh allocation every time."""
    monkeypatch.setattr(L, "_scratch", {})
    monkeypatch.setattr(L, "_scratch_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(L, "_capturing", lambda: False)
    a = L.stream_scratch(100, 0, "x", stream=7)
    assert a.numel() >= 100 and a.dtype == torch.uint8
    assert L.stream_scratch(100, 0, "x", stream=7) is a
    assert L.stream_scratch(100, 0, "x", stream=8) is not a
    assert L.stream_scratch(100, 0, "y", stream=7) is not a
    big = L.stream_scratch(a.numel() + 1, 0, "x", stream=7)
    assert big is not a and big.numel() > a.numel()
    assert L.stream_scratch(10, 0, "x", stream=7) is big
    monkeypatch.setattr(L, "_capturing", lambda: True)
    c1, c2 = (L.stream_scratch(10, 0, "x", stream=7) for _ in range(2))
    assert c1 is not big and c2 is not c1
