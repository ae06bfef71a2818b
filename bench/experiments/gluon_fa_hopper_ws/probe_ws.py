"""Smallest warp_specialize + wgmma probe for sm_90a (offline compile only)."""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)


@gluon.jit
def _producer(a_desc, b_desc, a_smem, b_smem, full, empty):
    mbarrier.wait(empty, 1)
    mbarrier.expect(full, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [0, 0], full, a_smem)
    tma.async_copy_global_to_shared(b_desc, [0, 0], full, b_smem)


@gluon.jit
def _consumer(a_smem, b_smem, full, empty, c_desc, WG: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, 128, 16])
    mbarrier.wait(full, 0)
    acc = gl.zeros([64, 128], gl.float32, layout)
    tok = warpgroup_mma(a_smem.index(WG), b_smem.permute((1, 0)), acc, use_acc=False, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
    mbarrier.arrive(empty, count=1)
    a_smem.index(WG).store(acc.to(gl.bfloat16))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [WG * 64, 0], a_smem.index(WG))
    tma.store_wait(0)


@gluon.jit
def probe_kernel(a_desc, b_desc, c_desc, REGS_C: gl.constexpr, REGS_P: gl.constexpr):
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 128], a_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [128, 128], b_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(full, count=1)
    mbarrier.init(empty, count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, full, empty, c_desc, 0)),
        (_consumer, (a_smem, b_smem, full, empty, c_desc, 1)),
        (_producer, (a_desc, b_desc, a_smem.index(0), b_smem, full, empty)),
    ], [4, 1], [REGS_C, REGS_P])


def desc_sig(block):
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return f"tensordesc<bf16[{block[0]}, {block[1]}],{layout!r}>"


if __name__ == "__main__":
    regs_c = int(sys.argv[1]) if len(sys.argv) > 1 else 240
    regs_p = int(sys.argv[2]) if len(sys.argv) > 2 else 24
    sig = {"a_desc": desc_sig([64, 128]), "b_desc": desc_sig([128, 128]), "c_desc": desc_sig([64, 128]),
           "REGS_C": "constexpr", "REGS_P": "constexpr"}
    src = GluonASTSource(probe_kernel, sig, {"REGS_C": regs_c, "REGS_P": regs_p}, {})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=1))
    import re
    ptx = k.asm["ptx"]
    print("compiled. shared", k.metadata.shared,
          "num_warps", k.metadata.num_warps)
    for pat in ("maxnreg", "setmaxnreg", "wgmma.mma_async", "mbarrier.arrive", "bar.sync", "barrier.sync",
                "bar.arrive", "mbarrier.try_wait"):
        print(f"{pat}: {len(re.findall(re.escape(pat), ptx))}")
    for line in ptx.splitlines():
        if "setmaxnreg" in line or ".maxnreg" in line or "reqntid" in line or "maxntid" in line:
            print("  ", line.strip())
    open("/tmp/probe.ptx", "w").write(ptx)
    open("/tmp/probe.ttgir", "w").write(k.asm["ttgir"])
