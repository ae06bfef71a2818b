"""Compiling the kernels for a GPU that is not here: what a launch on that GPU would compile.

    with compile_only((9, 0)) as kernels:      # an H100 / H200
        longctx.decode(q, k_cache, v_cache)    # CPU tensors
    kernels[0].asm["cubin"], kernels[0].metadata.shared

Inside the block every Triton or Gluon kernel launch compiles for that compute capability and
returns without running. Triton's own binder specialises the arguments as a launch on the GPU
would (each pointer's 16-byte alignment, ints equal to 1 or multiples of 16, the constexprs),
and Triton compiles the kernel down to a cubin with the ptxas it ships. The wrappers make the
launch choices of that GPU (programmatic dependent launch from sm_90, the decode kernel's e4m3
widening from sm_89, the fp8 cache's refusal below sm_89), and CPU tensors take the Triton
kernels. Nothing runs: what a call returns holds whatever torch.empty left there, so a block
may chain calls (a whole model step) but its values mean nothing.

For what CI cannot otherwise see: whether every kernel a launch on an A100 or an H100 would run
compiles with the installed Triton (tests/test_compile_targets.py, run by .ci/run at both ends
of the supported Triton range, where the GPU machines have only one), and the cubins whose SASS
bench/compile_decode.py reads. Not covered: the Gluon Hopper prefill kernel through
`longctx.attention` (the dispatch takes it for CUDA tensors only; call
`longctx.kernels.prefill_hopper.hopper_attention_fwd` inside the block) and the fast launch path
(kernels/launch.py, off inside the block: it launches).
"""

from __future__ import annotations

import contextlib
import importlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource, CompiledKernel, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

__all__ = ["compile_only", "compile_kernel", "bind", "target", "disassemble", "innermost_loops",
           "SMS"]

# SM counts of the GPUs each capability stands for (launch rules size grids by them).
SMS = {(8, 0): 108, (8, 9): 128, (9, 0): 132}

# The kernel modules, imported on entry so that every module's helper names can be replaced.
_MODULES = ("longctx.kernels.utils", "longctx.kernels.launch", "longctx.kernels.decode",
            "longctx.kernels.merge", "longctx.kernels.fused", "longctx.kernels.gemv",
            "longctx.kernels.allreduce", "longctx.kernels.ring_sync", "longctx.kernels.prefill",
            "longctx.fp8")


def target(capability: tuple[int, int]) -> GPUTarget:
    """Triton's target for a CUDA GPU of `capability` ((9, 0): sm_90)."""
    return GPUTarget("cuda", capability[0] * 10 + capability[1], 32)


def bind(fn: JITFunction, backend, *args, **kwargs) -> tuple:
    """(signature, constexprs, attrs, options) of a launch of `fn` with these arguments on
    `backend`'s target, as JITFunction.run computes them (Triton's binder specialises each
    argument)."""
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    return signature, constexprs, attrs, options


def compile_kernel(fn: JITFunction, capability: tuple[int, int], *args, **kwargs
                   ) -> CompiledKernel:
    """The binary a launch `fn[grid](*args, **kwargs)` would compile on a GPU of `capability`
    (tensors' data pointers are read for their alignment only)."""
    tgt = target(capability)
    return _compile(fn, tgt, bind(fn, make_backend(tgt), *args, **kwargs))


def _compile(fn: JITFunction, tgt: GPUTarget, bound: tuple) -> CompiledKernel:
    """triton.compile of `fn` for `tgt` with `bind`'s (signature, constexprs, attrs, options)."""
    signature, constexprs, attrs, options = bound
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    else:
        source = ASTSource
    return triton.compile(source(fn, signature, constexprs, attrs), target=tgt,
                          options=options.__dict__)


@contextlib.contextmanager
def compile_only(capability: tuple[int, int]) -> Iterator[list[CompiledKernel]]:
    """Inside the block, kernel launches compile for a GPU of `capability` ((8, 0): A100,
    (9, 0): H100 / H200) and do not run; yields the list of compiled kernels, one per launch
    (a launch whose binary an earlier one in the block compiled appends that binary again).
    Compilation errors propagate. Not thread-safe: it replaces process-wide functions (Triton's
    JITFunction.run, longctx's device helpers) until the block ends."""
    from longctx import backend
    from longctx.kernels import utils
    from longctx.kernels.launch import fast_launch

    for name in _MODULES:
        importlib.import_module(name)
    tgt = target(capability)
    be = make_backend(tgt)
    compiled: list[CompiledKernel] = []
    cache: dict[tuple, CompiledKernel] = {}

    def run(fn, *args, grid, warmup, **kwargs):  # JITFunction.run, compiling only
        bound = bind(fn, be, *args, **kwargs)
        key = (fn, *map(str, bound))
        if key not in cache:
            cache[key] = _compile(fn, tgt, bound)
        compiled.append(cache[key])
        return cache[key]

    pdl = {**utils.FP_FUSION, "USE_PDL": capability >= (9, 0)}
    if capability >= (9, 0):
        pdl["launch_pdl"] = True
    helpers = {"pdl_launch": lambda device: dict(pdl),
               "device_capability": lambda device: capability,
               "device_sms": lambda device: SMS.get(capability, 132)}
    originals = {h: getattr(utils, h) for h in helpers}
    saved = (JITFunction.run, backend._forced)

    def swap(table: dict, other: dict) -> None:
        # Every longctx module's copy of a helper: those loaded now, and (at the end) any that a
        # module imported inside the block took from the patched kernels.utils.
        for name, mod in list(sys.modules.items()):
            if name.startswith("longctx"):
                for h, fn in table.items():
                    if getattr(mod, h, None) is other[h]:
                        setattr(mod, h, fn)

    try:
        JITFunction.run = run
        backend._forced = True  # CPU tensors take the Triton kernels
        swap(helpers, originals)
        with fast_launch(False):
            yield compiled
    finally:
        swap(originals, helpers)
        JITFunction.run, backend._forced = saved


def disassemble(cubin: bytes) -> str:
    """A cubin's SASS, by the nvdisasm that Triton ships."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
        return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True,
                              check=True).stdout


def innermost_loops(sass: str) -> list[list[str]]:
    """The instructions of each innermost SASS loop (a backward branch enclosing no other), in
    address order."""
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        m = re.match(r"^\s*\.(L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            labels.update({p: len(ins) for p in pending})
            pending = []
            ins.append(m.group(1))
    spans = []
    for i, text in enumerate(ins):
        m = re.search(r"BRA\s.*`\(\.(L_x_\d+)\)", text)
        if m and labels.get(m.group(1), i + 1) < i:
            spans.append((labels[m.group(1)], i))
    return [ins[a:e + 1] for a, e in spans
            if not any(a <= a2 and e2 <= e and (a2, e2) != (a, e) for a2, e2 in spans)]
