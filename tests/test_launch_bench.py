"""launch/bench.py as a user starts it: on a machine without CUDA it composes its Hydra config and
stops with a clear message (the benchmarks themselves need a GPU; BENCHMARKS.md). The GPUs are
hidden from it, so it runs on a GPU machine too."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_bench_without_cuda_says_so(tmp_path: Path, case: str) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "launch" / "bench.py"), f"case={case}",
                        f"output_dir={tmp_path}"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 1, r.stderr
    assert "launch/bench.py needs a CUDA GPU" in r.stderr, r.stderr


def test_interleaved_ms_takes_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill row's implementations are timed in turns, round after round (so that a drift of
    the GPU's clocks meets them alike), each name getting its rounds' times sorted."""
    sys.path.insert(0, str(ROOT / "launch"))
    try:
        import bench
    finally:
        sys.path.remove(str(ROOT / "launch"))
    calls: list[str] = []
    fake = iter([5.0, 1.0, 3.0, 2.0, 4.0, 0.5])

    def fake_bench_ms(fn, warmup_ms, rep_ms):
        calls.append(fn())
        return next(fake)

    monkeypatch.setattr(bench, "bench_ms", fake_bench_ms)
    out = bench.interleaved_ms({"a": lambda: "a", "b": lambda: "b"}, rounds=3)
    assert calls == ["a", "b"] * 3
    assert out == {"a": [3.0, 4.0, 5.0], "b": [0.5, 1.0, 2.0]}
