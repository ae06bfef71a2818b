"""Every kernel a launch on an A100 (sm_80) or an H100 / H200 (sm_90) runs compiles, for that GPU,
with the installed Triton: no GPU needed (longctx.kernels.offline.compile_only).

The GPU machines have one Triton (3.6) and CI has none of their GPUs, so this is where a newer
Triton's code generation meets the kernels' real launches: .ci/run runs it with Triton 3.6 and
3.9. The interpreter process cannot see it (it runs no compiler), so it is in the main process.
The calls are a tiny model's prefill and decode steps (every kernel of the model path at several
head_dims, batches, dtypes and caches), the decode kernel's other launches and the parallel
layouts' kernels (the Gluon Hopper prefill has its own offline compile test,
tests/test_prefill_hopper.py `test_gluon_kernel_compiles_for_sm90`). Shapes are small: a
kernel's code depends on its constexprs and specialisations, which these launches take as the
real ones do. Every kernel's shared memory must fit the target, and on sm_90, where the launch
rules were tuned, no kernel's loop may spill.
"""

from __future__ import annotations

import re

import pytest
import torch

from longctx.config import ModelArgs
from longctx.fp8 import FP8
from longctx.kernels.offline import compile_only, disassemble, innermost_loops
from longctx.model import Transformer

TARGETS = {"sm80": (8, 0), "sm90": (9, 0)}
# The most shared memory one program may take: an A100's 163 KiB, an H100's 227 KiB (a launch
# asking more fails with Triton's OutOfResources, which compiling alone does not raise).
SMEM_LIMIT = {"sm80": 163 * 1024, "sm90": 227 * 1024}


def _names(kernels) -> set[str]:
    return {k.name for k in kernels}


def _model_step(cap, *, dtype=torch.bfloat16, batch=1, n_heads=16, n_kv_heads=2, head_dim=128,
                kv_cache_dtype=None, qkv_bias=False):
    """The kernels of a one-layer model's chunked prefill (300 positions in chunks of 128) and one
    decode step, compiled for capability `cap`."""
    args = ModelArgs(n_layers=1, dim=256, n_heads=n_heads, n_kv_heads=n_kv_heads,
                     head_dim=head_dim, intermediate_size=512, vocab_size=128, qkv_bias=qkv_bias)
    model = Transformer(args).to(dtype)
    with torch.no_grad(), compile_only(cap) as kernels:
        model.setup_caches(batch, 512, kv_cache_dtype)
        tokens = torch.zeros(batch, 300, dtype=torch.long)
        model.prefill(tokens, torch.arange(300), chunk=128)
        model.decode_step(tokens[:, 0], torch.full((batch,), 300))
    return kernels


MODEL_CASES = {
    "bf16-b1-d128": dict(),
    "fp16-b4-d128-bias": dict(dtype=torch.float16, batch=4, qkv_bias=True),
    "bf16-b2-d96-group3": dict(batch=2, n_heads=6, head_dim=96),
    "bf16-b1-d40": dict(head_dim=40),
    "fp16-b1-d256-mqa": dict(dtype=torch.float16, n_heads=8, n_kv_heads=1, head_dim=256),
}


@pytest.mark.parametrize("case", MODEL_CASES)
@pytest.mark.parametrize("target", TARGETS)
def test_model_kernels_compile(target: str, case: str) -> None:
    kernels = _model_step(TARGETS[target], **MODEL_CASES[case])
    names = _names(kernels)
    expected = {"_attn_fwd_kernel", "_decode_split_kernel", "_rms_norm_kernel",
                "_rope_store_kv_kernel", "_silu_mul_kernel"}
    expected.add("_skinny_kernel" if MODEL_CASES[case].get("batch", 1) > 1 else "_gemv_kernel")
    assert expected <= names, f"not launched: {expected - names}"
    _assert_fits(kernels, target)
    for k in kernels:
        assert k.asm.get("cubin"), f"{k.name}: no cubin"
        assert k.metadata.target.arch == TARGETS[target][0] * 10 + TARGETS[target][1]
    pdl = {k.name: k.metadata.launch_pdl for k in kernels if k.name == "_decode_split_kernel"}
    assert pdl == {"_decode_split_kernel": target == "sm90"}  # PDL from sm_90 on
    if target == "sm90":
        _assert_loops_keep_to_registers(kernels)


def _assert_fits(kernels, target: str) -> None:
    for k in kernels:
        assert k.metadata.shared <= SMEM_LIMIT[target], (k.name, k.metadata.shared)


def _assert_loops_keep_to_registers(kernels) -> None:
    """No innermost loop of any kernel loads or stores local memory (register spills): the
    launch rules were tuned on sm_90 and their configs compile without spills there. (sm_80
    has some in the prefill kernel's loops: 4 per key block at D <= 128, 32-64 at D = 256.)"""
    for k in {k.hash: k for k in kernels}.values():
        for loop in innermost_loops(disassemble(k.asm["cubin"])):
            spills = [x for x in loop if x.split()[0].split(".")[0] in ("LDL", "STL")]
            assert not spills, f"{k.name} ({k.metadata.num_warps} warps): {spills[:4]}"


def test_fp8_cache_compiles_on_sm90() -> None:
    kernels = _model_step((9, 0), kv_cache_dtype=FP8)
    assert {"_store_fp8_kernel", "_rope_store_kv_kernel", "_attn_fwd_kernel",
            "_decode_split_kernel"} <= _names(kernels)
    _assert_loops_keep_to_registers(kernels)


# Bytes a lane stores to shared memory per SASS store, by the opcode's width suffixes.
_STORE_BYTES = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1, "M88.4": 16, "M88.2": 8}


def _shared_store_bytes(instruction: str) -> int:
    op = re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0]
    if not op.startswith("STS"):
        return 0
    return next((n for suffix, n in _STORE_BYTES.items() if op.endswith(suffix)), 4)


def test_fp8_decode_loop_writes_only_v_tile_to_shared_memory() -> None:
    """An fp8 cache's split loop on sm_90 writes one float16 tile a key block to shared memory,
    V's (widened by the impure cvt, for ldmatrix): K's fp8 tile goes into the dot's operand by
    Triton's own conversion. A float16 copy of K as well cost 12% at 32/4 heads 1 x 262144 on an
    H100 (BENCHMARKS.md, fp8 section). The other stores (P for P @ V, the row maxima) are small."""
    from longctx.kernels import decode as kd

    block_n, warps = 64, 2
    with compile_only((9, 0)) as kernels:
        q = torch.empty(1, 16, 128, dtype=torch.bfloat16)
        cache = torch.empty(1, 4096, 2, 128, dtype=FP8)
        s = torch.empty(1, 4096, 2)
        kd.flash_decode_partials(q, cache, cache, torch.full((1,), 4096, dtype=torch.int32),
                                 None, 0.1, 4, config=(block_n, warps, 2), k_scale=s, v_scale=s)
    (split,) = [k for k in kernels if k.name == "_decode_split_kernel"]
    loops = [b for b in innermost_loops(disassemble(split.asm["cubin"]))
             if any("HMMA" in x for x in b)]
    assert len(loops) == 1, f"{len(loops)} MMA loops"
    stored = 32 * warps * sum(_shared_store_bytes(x) for x in loops[0])  # bytes a key block
    v_tile = block_n * 128 * 2
    assert v_tile <= stored < 1.5 * v_tile, (stored, v_tile)


def test_fp8_cache_is_refused_below_sm89() -> None:
    """Triton has no e4m3 on an A100: a clear refusal naming the setting, not a CompilationError
    from inside a kernel."""
    with pytest.raises(ValueError, match="kv_cache_dtype fp8_e4m3 needs a GPU of compute "
                                         "capability 8.9 or later.*has 8.0"):
        _model_step((8, 0), kv_cache_dtype=FP8)
    import longctx

    q = torch.empty(1, 8, 64, dtype=torch.bfloat16)
    k = torch.empty(1, 32, 2, 64, dtype=FP8)
    s = torch.empty(1, 32, 2)
    with compile_only((8, 0)), pytest.raises(ValueError, match="an fp8 k_cache needs a GPU"):
        longctx.decode(q, k, k, k_scale=s, v_scale=s)
    with compile_only((8, 0)), pytest.raises(ValueError, match="an fp8 k needs a GPU"):
        longctx.attention(q[:, None], k, k, causal=True, k_scale=s, v_scale=s)


@pytest.mark.parametrize("target", TARGETS)
def test_decode_launches_compile(target: str) -> None:
    """The decode kernel's launches that the model cases above do not make: a paged cache,
    splits merged by the separate merge kernel, a float32 q, (sm_90) a paged fp8 cache, and the
    long-context configs of the decode and prefill kernels (262144 keys at head_dim 128 and
    256, where their tiles take the most shared memory)."""
    import longctx

    cap = TARGETS[target]
    with compile_only(cap) as kernels:
        for d in (128, 256):
            kc = torch.empty(1, 262144, 2, d, dtype=torch.bfloat16)
            longctx.decode(torch.empty(1, 16, d, dtype=torch.bfloat16), kc, kc)
            kc = torch.empty(1, 4096, 2, d, dtype=torch.bfloat16)
            longctx.attention(torch.empty(1, 4096, 16, d, dtype=torch.bfloat16), kc, kc,
                              causal=True)
        q = torch.empty(2, 16, 128, dtype=torch.float16)
        pages = torch.empty(64, 16, 2, 128, dtype=torch.float16)
        table = torch.zeros(2, 32, dtype=torch.int32)
        lens = torch.full((2,), 500, dtype=torch.int32)
        longctx.decode(q, pages, pages, cache_seqlens=lens, block_table=table, num_splits=16)
        k = torch.empty(1, 4096, 2, 64)
        longctx.decode(torch.empty(1, 16, 64), k, k, num_splits=8)
        if cap >= (8, 9):
            fp8 = torch.empty(64, 16, 2, 128, dtype=FP8)
            s = torch.empty(64, 16, 2)
            longctx.decode(q, fp8, fp8, cache_seqlens=lens, block_table=table, k_scale=s,
                           v_scale=s)
    assert {"_decode_split_kernel", "_merge_kernel", "_attn_fwd_kernel"} <= _names(kernels)
    _assert_fits(kernels, target)
    if target == "sm90":
        _assert_loops_keep_to_registers(kernels)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("target", TARGETS)
def test_parallel_kernels_compile(target: str, world: int) -> None:
    """The kernels of the tensor-parallel decode (the push all-reduce, plain and fused with the
    residual add and RMSNorm, the GEMV pushing its partial) and of the ring prefill (the
    copy-engine ring's flags, merging into a running state)."""
    from longctx.kernels.allreduce import PushBuffers, push_all_reduce
    from longctx.kernels.gemv import gemv
    from longctx.kernels.merge import merge_into_triton
    from longctx.kernels.ring_sync import ring_sync

    n, slot = 8192, 8 * 8192
    bufs = PushBuffers(torch.empty(3 * world * slot, dtype=torch.int16),
                       torch.zeros(world, dtype=torch.int64), torch.zeros(4, dtype=torch.int32),
                       1, slot)
    x = torch.empty(1, n, dtype=torch.bfloat16)
    w = torch.empty(n, dtype=torch.bfloat16)
    with compile_only(TARGETS[target]) as kernels:
        gemv(torch.empty(1, 4096, dtype=torch.bfloat16),
             torch.empty(n, 4096, dtype=torch.bfloat16), push=bufs)
        for early in (False, True):
            push_all_reduce(x, bufs, residual=x, norm_weight=w, eps=1e-5, pushed=True,
                            early=early)
        push_all_reduce(torch.empty(8, n, dtype=torch.bfloat16), bufs)
        flags = torch.zeros(4, dtype=torch.int32)
        ring_sync(flags, flags, flags, arrived=(0, 1), free=(1, 1), wait_arrived=(0, 1),
                  wait_free=(1, 1))
        merge_into_triton(torch.empty(1, 64, 8, 128), torch.empty(1, 64, 8),
                          torch.empty(1, 64, 8, 128, dtype=torch.bfloat16),
                          torch.empty(1, 64, 8))
    assert {"_gemv_kernel", "_push_all_reduce_kernel", "_ring_sync_kernel",
            "_merge_into_kernel"} <= _names(kernels)
    if target == "sm90":
        _assert_loops_keep_to_registers(kernels)


def test_every_launch_says_fp_fusion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kernel compiles with FMA fusion although Triton's default says no: each launch
    states it (kernels/utils.py FP_FUSION), as the kernels were tested and timed, so Triton 3.9
    has nothing to warn about and 3.10's default (off) changes nothing."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    kernels = _model_step((9, 0), kv_cache_dtype=FP8) + _model_step((8, 0), batch=4)
    from longctx.kernels.allreduce import PushBuffers, push_all_reduce
    from longctx.kernels.gemv import gemv
    from longctx.kernels.merge import merge_into_triton
    from longctx.kernels.ring_sync import ring_sync

    bufs = PushBuffers(torch.empty(3 * 2 * 8192, dtype=torch.int16),
                       torch.zeros(2, dtype=torch.int64), torch.zeros(4, dtype=torch.int32), 0,
                       8192)
    x = torch.empty(1, 8192, dtype=torch.bfloat16)
    with compile_only((9, 0)) as more:
        gemv(x, torch.empty(8192, 8192, dtype=torch.bfloat16), push=bufs)
        push_all_reduce(x, bufs, residual=x, norm_weight=x[0], eps=1e-5, pushed=True)
        flags = torch.zeros(4, dtype=torch.int32)
        ring_sync(flags, flags, flags, arrived=(0, 1))
        merge_into_triton(torch.empty(1, 64, 8, 128), torch.empty(1, 64, 8),
                          torch.empty(1, 64, 8, 128), torch.empty(1, 64, 8))
        import longctx

        kc = torch.empty(1, 4096, 2, 128, dtype=torch.float16)
        longctx.decode(torch.empty(1, 16, 128, dtype=torch.float16), kc, kc, num_splits=16)
    unfused = {k.name for k in kernels + more if not k.metadata.enable_fp_fusion}
    assert not unfused, f"launched without FP_FUSION: {sorted(unfused)}"
    assert len(_names(kernels + more)) >= 12


def test_compile_only_puts_back_what_it_replaced() -> None:
    """After the block (also one left by an error): Triton's launch, the CPU routing and every
    module's device helpers are the real ones again."""
    from triton.runtime.jit import JITFunction

    import longctx.kernels.decode as kd
    from longctx import backend, fp8
    from longctx.kernels import utils

    def state():
        return (JITFunction.run, backend._forced, kd.device_capability, kd.pdl_launch,
                kd.device_sms, fp8.device_capability, utils.device_capability)

    before = state()
    with pytest.raises(RuntimeError, match="inside"), compile_only((9, 0)):
        assert kd.device_capability(torch.device("cpu")) == (9, 0)
        assert kd.pdl_launch(torch.device("cpu"))["USE_PDL"]
        raise RuntimeError("inside")
    assert state() == before
    assert kd.device_capability(torch.device("cpu")) is None
