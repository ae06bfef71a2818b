# PROTOTYPE check (bench/tried/gemv_ring): the ring GEMV (what kernels/gemv.py's gemv runs for
# plain / gated weights with K <= 4 steps) against the Triton GEMV and float64, bf16, on a GPU:
#   python bench/tried/gemv_ring/check.py
import torch, sys
from longctx.kernels.gemv import gemv
torch.manual_seed(0)
for N, K, gated in ((5120, 8192, False), (22016, 8192, True), (37, 4096, False), (38, 6144, True)):
    w = torch.randn(N, K, device="cuda").bfloat16(); x = torch.randn(1, K, device="cuda").bfloat16()
    got = gemv(x, w, gated=gated)  # the ring kernel (proto)
    tri = gemv(x, w, gated=gated, config=(4, 2048, 8) if K % 2048 == 0 else (4, 1024, 4))  # Triton
    ref = x.double() @ w.double().T
    plain = torch.nn.functional.linear(x, w)
    if gated:
        g, u = ref.chunk(2, -1); ref = torch.nn.functional.silu(g) * u
        pg, pu = plain.chunk(2, -1); plain = (torch.nn.functional.silu(pg) * pu)
    e, et, ep = [(t.double() - ref).abs().max().item() for t in (got, tri, plain)]
    print(f"N={N} K={K} gated={gated}: ring {e:.3e} triton {et:.3e} torch {ep:.3e} ok={e <= 2 * ep + 1e-6}")
