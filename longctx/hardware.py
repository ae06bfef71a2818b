"""What the machine offers a decode run: free memory per device and its read bandwidth."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import torch


def available_memory(device: torch.device) -> int:
    """Bytes this rank may allocate: free memory of a CUDA device; on a CPU, the host's available
    memory divided among the ranks on this host (torchrun's LOCAL_WORLD_SIZE)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return avail // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def read_bandwidth(device: torch.device) -> tuple[float, str]:
    """(bytes/s, what was measured). CUDA: HBM read bandwidth of a streaming read kernel, the
    physical floor for decode. CPU: a memcpy of 128 MiB, counting the bytes read; only a rough
    yardstick, not a physical limit."""
    if device.type == "cuda":
        from longctx.kernels.bandwidth import read_bandwidth as hbm_read_bandwidth

        with torch.cuda.device(device):
            return hbm_read_bandwidth(2 << 30), "HBM read bandwidth (streaming read kernel, 2 GiB)"
    src = torch.ones(32 << 20, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    t0 = time.perf_counter()
    reps = 5
    for _ in range(reps):
        dst.copy_(src)
    s = time.perf_counter() - t0
    return reps * src.nbytes / s, "CPU memcpy read rate (128 MiB), not a physical limit"


def code_commit() -> str | None:
    """The longctx commit being run: $LONGCTX_COMMIT when set (a copy of the tree without its
    .git, as on a rented GPU machine), else `git rev-parse` of the checkout with "-dirty" added
    when tracked files differ from it (a result of uncommitted code, or of a copied tree whose
    .git is older, must not pass for the commit's), else None."""
    if os.environ.get("LONGCTX_COMMIT"):
        return os.environ["LONGCTX_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None  # do not report an enclosing repository's commit
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                             capture_output=True, text=True)
        # content, not timestamps: a copied tree has every file's stat changed
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=root,
                               capture_output=True).returncode == 1
    except OSError:
        return None
    commit = out.stdout.strip()
    return (commit + "-dirty" * dirty) or None
