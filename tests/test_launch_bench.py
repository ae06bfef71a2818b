"""launch/bench.py as a user starts it: on a machine without CUDA it composes its Hydra config and
stops with a clear message (the benchmarks themselves need a GPU; BENCHMARKS.md)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine it would run the benchmark")
@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_bench_without_cuda_says_so(tmp_path: Path, case: str) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "launch" / "bench.py"), f"case={case}",
                        f"output_dir={tmp_path}"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 1, r.stderr
    assert "launch/bench.py needs a CUDA GPU" in r.stderr, r.stderr
