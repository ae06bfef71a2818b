"""Two pytest processes, as in Triton's own repository; `make test` runs both, on any machine.

- The main process (`pytest`): torch-only tests, and tests marked `gpu` where CUDA is (skipped,
  visibly, where it is not).
- The interpreter process (`TRITON_INTERPRET=1 pytest`): only tests marked `interpreter`, which
  run the Triton kernels on CPU tensors under the Triton interpreter. The GPUs are hidden from it,
  so it is the same run on a GPU host as on a CPU-only one.

A test marked both runs in both: its kernels get `device` (the fixture) / `tests.env.DEVICE`,
"cuda" in the main process, "cpu" in the interpreter. Tests the other process runs are
deselected (counted as such), never skipped or returned from early.

TRITON_INTERPRET is read once, when longctx and Triton are imported (a @triton.jit kernel is
compiled or interpreted from its definition on), so it is set on the command line, not here.
"""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    # Before torch initialises CUDA: code that picks CUDA where it exists (a test, a spawned
    # rank) must see the CPU-only machine the interpreter process stands for.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

# pytest-xdist's workers share the machine's cores: each takes its share for torch's CPU threads,
# and the ranks it spawns inherit it (else every worker starts one thread per core: 8 workers on
# 32 cores ask for 256).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from tests.env import DEVICE, HAS_CUDA, INTERPRET  # noqa: E402


def pytest_report_header(config) -> str:
    if INTERPRET:
        return "longctx: interpreter process: `interpreter` tests, Triton kernels on CPU tensors"
    return (f"longctx: main process (CUDA: {'yes' if HAS_CUDA else 'no'}); `interpreter` tests run "
            "in `TRITON_INTERPRET=1 pytest` (make test runs both)")


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    no_cuda = pytest.mark.skip(reason="needs a CUDA device (gpu marker); this machine has none")
    for item in items:
        gpu, interp = "gpu" in item.keywords, "interpreter" in item.keywords
        if "device" in item.fixturenames and not (gpu and interp):
            raise pytest.UsageError(f"{item.nodeid} takes the `device` fixture: mark it both "
                                    "gpu and interpreter (it runs in both processes)")
        if INTERPRET:
            (keep if interp else drop).append(item)
        elif interp and not (gpu and HAS_CUDA):
            drop.append(item)  # the interpreter process runs it
        else:
            if gpu and not HAS_CUDA:
                item.add_marker(no_cuda)
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def device() -> str:
    """Where a test marked both gpu and interpreter runs its kernels: "cuda" in the main process,
    "cpu" (the interpreter) in the interpreter process."""
    return DEVICE
