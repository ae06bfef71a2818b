"""The model's fused small ops (longctx.kernels.fused; the interpreter on CPU) against their torch
versions in longctx.ops."""

import pytest
import torch

from longctx import ops
from longctx.backend import force_triton

HALF = [torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def _both(fn, *args):
    want = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    with force_triton(not args[0].is_cuda):
        got = fn(*args)
    return got, want


def _tol(dtype):
    # one rounding step of the output dtype: the kernels may round fp32 math differently
    return dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("shape,scale", [((3, 200), 3.0), ((2, 1, 1024), 3.0), ((1, 8192), 3.0),
                                         ((4, 96), 3e-3)])  # tiny x: eps matters
def test_rms_norm(dtype, shape, scale, device):
    x = (torch.randn(shape, device=device) * scale).to(dtype)
    w = (torch.rand(shape[-1], device=device) + 0.5).to(dtype)
    got, want = _both(ops.rms_norm, x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("B,S,H,D,decode", [(2, 5, 3, 64, False), (3, 1, 20, 128, True)])
def test_rope(dtype, B, S, H, D, decode, device):
    cos, sin = ops.rope_tables(64, D, 10000.0, torch.device(device))
    x = torch.randn(B, S, H, D, device=device).to(dtype)
    if decode:  # one position per sequence, as decode_step passes them
        pos = torch.tensor([0, 17, 63], device=device)[:, None]
    else:       # the same positions for every sequence, as prefill passes them (stride 0)
        pos = torch.arange(10, 10 + S, device=device)[None].expand(B, -1)
    got, want = _both(ops.apply_rope, x, cos, sin, pos)
    assert got.dtype == dtype and got.shape == (B, S, H, D)
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))
    # position 0 is the identity
    if decode:
        torch.testing.assert_close(got[0].float(), want[0].float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_silu_mul(dtype, device):
    g = (torch.randn(3, 1, 2500, device=device) * 4).to(dtype)
    u = torch.randn(3, 1, 2500, device=device).to(dtype)
    got, want = _both(ops.silu_mul, g, u)
    assert got.dtype == dtype and got.shape == g.shape
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))
