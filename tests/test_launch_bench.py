"""launch/bench.py as a user starts it: on a machine without CUDA it composes its Hydra config and
stops with a clear message (the benchmarks themselves need a GPU; BENCHMARKS.md). The GPUs are
hidden from it, so it runs on a GPU machine too."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    bench = _bench_module()
    calls: list[str] = []
    fake = iter([5.0, 1.0, 3.0, 2.0, 4.0, 0.5])

    def fake_bench_ms(fn, warmup_ms, rep_ms):
        calls.append(fn())
        return next(fake)

    monkeypatch.setattr(bench, "bench_ms", fake_bench_ms)
    out = bench.interleaved_ms({"a": lambda: "a", "b": lambda: "b"}, rounds=3)
    assert calls == ["a", "b"] * 3
    assert out == {"a": [3.0, 4.0, 5.0], "b": [0.5, 1.0, 2.0]}


def _bench_module():
    """launch/bench.py as a module."""
    sys.path.insert(0, str(ROOT / "launch"))
    try:
        import bench
    finally:
        sys.path.remove(str(ROOT / "launch"))
    return bench


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="bench", overrides=list(overrides))


def test_head_dim_tables_plan_their_rows() -> None:
    """decode_table=head_dims and prefill_table=head_dims: rows at head_dim 96, 192 and those of
    their tiles with cuDNN among the peers; the default tables keep their single head_dim (decode) and rows."""
    bench = _bench_module()
    cfg = _compose("decode_table=head_dims", "prefill_table=head_dims")
    shapes = [(64, 1024), (8, 8192), (1, 65536), (1, 262144)]
    assert bench.decode_plan(cfg.decode) == [(d, b, n) for d in (96, 192, 128) for b, n in shapes]
    assert "sdpa_cudnn" in cfg.decode.peers and "sdpa_cudnn" in cfg.prefill.peers
    plan = bench.prefill_plan(cfg.prefill)
    assert [(d, hq, hkv, causal) for hq, hkv, d, _, causal, _ in plan] == [
        (d, 32, 32, causal) for d in (96, 192, 128, 256) for causal in (True, False)]
    assert all(lens == [16384] and not varlen for _, _, _, lens, _, varlen in plan)
    default = _compose()
    assert bench.decode_plan(default.decode) == [(128, b, n) for b, n in default.decode.shapes]
    assert len(bench.prefill_plan(default.prefill)) == 2 * 3 * 2


def test_fp8_decode_table_plans_its_rows() -> None:
    """decode_table=fp8: the default table's shapes at 16/2 heads, then four at CodeLlama-34B's
    heads per GPU (64/8, 32/4), an fp8 cache, longctx on bf16 and vLLM's fp8 kernel as peers."""
    bench = _bench_module()
    cfg = _compose("decode_table=fp8")
    default = _compose()
    four = [(64, 1024), (8, 8192), (1, 65536), (1, 262144)]
    assert bench.decode_rows(cfg.decode) == (
        [(16, 2, 128, b, n) for b, n in default.decode.shapes]
        + [(hq, hkv, 128, b, n) for hq, hkv in ((64, 8), (32, 4)) for b, n in four])
    assert cfg.decode.kv_cache_dtype == "fp8_e4m3" and cfg.decode.dtype == "bfloat16"
    assert list(cfg.decode.peers) == ["longctx_bf16", "vllm_fp8"]
    assert bench.decode_rows(default.decode) == [(16, 2, 128, b, n) for b, n in default.decode.shapes]


def test_vllm_peer_loads_with_vllm_stubbed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The vLLM kernel file imports vLLM's platform and Triton re-export: without vLLM they are
    stubbed for the import only (CUDA platform, Triton itself); a missing file says how to get it."""
    bench = _bench_module()
    monkeypatch.setattr(bench, "VLLM_PEER", tmp_path / "missing.py")
    with pytest.raises(FileNotFoundError, match="bench/fetch_vllm_peer.sh"):
        bench.load_vllm_peer()
    peer = tmp_path / "peer.py"
    peer.write_text("from vllm.platforms import current_platform\n"
                    "from vllm.triton_utils import tl, triton\n"
                    "is_hip_ = current_platform.is_rocm()\n")
    monkeypatch.setattr(bench, "VLLM_PEER", peer)
    before = {n for n in sys.modules if n == "vllm" or n.startswith("vllm.")}
    mod = bench.load_vllm_peer()
    import triton

    assert mod.is_hip_ is False and mod.triton is triton and mod.tl is triton.language
    assert {n for n in sys.modules if n == "vllm" or n.startswith("vllm.")} == before


def test_code_commit_says_when_the_tree_is_not_the_commit(tmp_path, monkeypatch):
    """Results record `code_commit()`: a checkout whose tracked files differ from HEAD (uncommitted
    code, or a copied tree under an older .git) reads "<hash>-dirty"; untracked files and
    timestamps alone do not count; $LONGCTX_COMMIT wins."""
    import importlib.util
    import shutil

    pkg = tmp_path / "longctx"
    pkg.mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / "longctx" / "hardware.py", pkg)
    spec = importlib.util.spec_from_file_location("hardware_copy", pkg / "hardware.py")
    hardware = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hardware)
    monkeypatch.delenv("LONGCTX_COMMIT", raising=False)
    assert hardware.code_commit() is None  # no .git there: not an enclosing repository's commit

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                       check=True, capture_output=True)
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "x")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path,
                          capture_output=True, text=True).stdout.strip()
    assert hardware.code_commit() == head
    (tmp_path / "untracked.txt").write_text("x")
    os.utime(pkg / "hardware.py", (0, 0))
    assert hardware.code_commit() == head
    with open(pkg / "hardware.py", "a") as f:
        f.write("# changed\n")
    assert hardware.code_commit() == head + "-dirty"
    monkeypatch.setenv("LONGCTX_COMMIT", "abc1234")
    assert hardware.code_commit() == "abc1234"


def test_model_rules_override_the_projection_configs(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/model_rules.py: a shape's entry gives its config, an unkeyed entry every other
    shape's, shapes left out keep the rule (no config passed) and a caller's own config stands;
    a malformed entry stops with its flag named. End to end on the CPU, the run's summary
    records the overrides."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import model_rules
    finally:
        sys.path.pop(0)
    from longctx.kernels import gemv as mod

    # Stand-ins with the real signatures that return the config they were given.
    def gemv(x, weight, config=None, gated=False, bias=None, push=None):
        return config

    def skinny_gemm(x, weight, bias=None, config=None, push=None):
        return config

    monkeypatch.setattr(mod, "gemv", gemv)  # both restored after the test
    monkeypatch.setattr(mod, "skinny_gemm", skinny_gemm)
    model_rules.apply_overrides({
        "gemv": model_rules.parse_entries(["5120x8192=8,512,4"], 3, "--gemv"),
        "skinny": model_rules.parse_entries(["5120x8192=32,128,4,6", "16,64,2,2"], 4,
                                            "--skinny")})
    x, qkv, o = torch.empty(1, 8192), torch.empty(5120, 8192), torch.empty(8192, 4096)
    assert mod.gemv(x, qkv, push=None) == (8, 512, 4)
    assert mod.gemv(x, o) is None
    assert mod.gemv(x, qkv, (2, 64, 1)) == (2, 64, 1)
    assert mod.skinny_gemm(x, qkv, None) == (32, 128, 4, 6)
    assert mod.skinny_gemm(x, o, push=None) == (16, 64, 2, 2)
    for bad in ("4,64", "5120=4,64,4", "axb=4,64,4"):
        with pytest.raises(SystemExit, match=f"--gemv: '{bad}' is not"):
            model_rules.parse_entries([bad], 3, "--gemv")
    # torchrun drops a "--" right after the script: without options all goes to decode.py.
    assert model_rules.split_argv(["a=1", "b=2"]) == ([], ["a=1", "b=2"])
    assert model_rules.split_argv(["--gemv", "--", "a=1"]) == (["--gemv"], ["a=1"])
    with pytest.raises(SystemExit, match="usage"):
        model_rules.split_argv(["--gemv", "4,64,4", "a=1"])

    r = subprocess.run([sys.executable, str(ROOT / "bench" / "model_rules.py"), "--gemv",
                        "4,64,4", "--", "gen_len=2", f"output={tmp_path / 'runs'}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    (summary,) = (tmp_path / "runs").glob("*/summary.json")
    assert json.loads(summary.read_text())["rule_overrides"] == {"gemv": {"*": [4, 64, 4]}}
