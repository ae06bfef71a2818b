"""Test harness: Triton kernels run under the Triton interpreter when there is no GPU.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so it is set here at
import time, before the test modules import longctx.kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker); this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def device() -> str:
    """Where kernel tests run: the GPU if there is one, else the CPU under the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"
