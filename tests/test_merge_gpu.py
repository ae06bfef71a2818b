"""merge_into on a GPU updates its accumulator in place: the same bits every time, also while
another stream's kernel shares the SMs.

Without a barrier between the reads of the old accumulator and the writes of the new one, a
warp that ran late read the LSE that another warp of its program had just stored. That needs
skewed warps, which a kernel on another stream (the ring's NCCL transfer; here a spinning
kernel) provides. On one H200, 1 to 2 of every 15 runs of a ring rank's 6 attention -> merge
steps went wrong that way (bench/results/merge-race-h200.txt); this test failed with that kernel.
"""

import pytest
import torch
import triton
import triton.language as tl

from longctx.kernels.utils import FP_FUSION
from longctx.merge import merge_into

pytestmark = pytest.mark.gpu


@triton.jit
def _spin(X, ITERS: tl.constexpr):
    """Keeps a few SMs busy for a few ms: strided loads of X (64M floats), one harmless store."""
    pid = tl.program_id(0)
    acc = tl.zeros([1024], tl.float32)
    for i in range(ITERS):
        acc += tl.load(X + ((pid * 37 + i * 7919) % 60000) * 1024 + tl.arange(0, 1024))
    offs = pid * 1024 + tl.arange(0, 1024)
    tl.store(X + offs, acc * 0.0 + tl.load(X + offs))


def test_merge_into_is_deterministic_beside_another_stream():
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, heads, d, parts = 16384, 32, 128, 6  # one ring step's query rows, 6 blocks merged
    o = torch.randn(parts, 1, rows, heads, d, device="cuda", generator=g).to(torch.bfloat16)
    lse = torch.randn(parts, 1, rows, heads, device="cuda", generator=g) * 4
    lse[1, :, : rows // 4] = float("-inf")  # empty parts too

    def run(hog: bool) -> tuple[torch.Tensor, torch.Tensor]:
        o_acc = torch.zeros(1, rows, heads, d, device="cuda")
        lse_acc = torch.full((1, rows, heads), float("-inf"), device="cuda")
        for p in range(parts):
            if hog:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    _spin[(16,)](big, ITERS=20000, num_warps=4, **FP_FUSION)
            merge_into(o_acc, lse_acc, o[p], lse[p], check=False)
        torch.cuda.synchronize()
        return o_acc, lse_acc

    side = torch.cuda.Stream()
    big = torch.randn(64 << 20, device="cuda", generator=g)
    o_ref, lse_ref = run(hog=False)
    for i in range(40):
        o_acc, lse_acc = run(hog=True)
        assert torch.equal(lse_acc, lse_ref), f"run {i}: LSE differs"
        assert torch.equal(o_acc, o_ref), \
            f"run {i}: O differs by up to {(o_acc - o_ref).abs().max().item():.3e}"
