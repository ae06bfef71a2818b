"""launch/decode.py end to end, as a user runs it (subprocesses): on the CPU, or on a GPU where
there is one (CUDA graphs, NCCL)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from longctx.config import ModelArgs
from tests.checkpoint_utils import (WORDS, hf_greedy, load_hf_model, save_hf_model,
                                    write_checkpoint, write_tokenizer)

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # a tiny model: threads only contend


def _run(tmp_path: Path, *overrides: str, nproc: int = 1) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "launch" / "decode.py")]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", str(ROOT / "launch" / "decode.py")]
    return subprocess.run([*cmd, f"output={tmp_path / 'runs'}", *overrides], cwd=tmp_path,
                          env=ENV, capture_output=True, text=True, timeout=240)


def _summary(tmp_path: Path) -> tuple[Path, dict]:
    (run_dir,) = (tmp_path / "runs").iterdir()  # exactly one directory per run
    return run_dir, json.loads((run_dir / "summary.json").read_text())


def test_default_run_is_the_tiny_model(tmp_path):
    r = _run(tmp_path)
    assert r.returncode == 0, r.stderr
    run_dir, s = _summary(tmp_path)
    assert {p.name for p in run_dir.iterdir()} == {"summary.json", "config.yaml", "rank0.log"}
    cuda = torch.cuda.is_available()
    assert (s["model"], s["dtype"], s["prompt_len"], s["decode_steps"], s["cuda_graphs"]) == (
        "tiny", "bfloat16" if cuda else "float32", 1024, 31, cuda)
    assert len(s["tokens"]) == 32 and s["decode_tokens_per_s"] > 0
    assert s["ms_per_token_p90"] >= s["ms_per_token_p50"] > 0
    assert len(s["ms_per_step"]) == 31 and min(s["ms_per_step"]) > 0
    assert s["decode_tokens_per_s"] == pytest.approx(31e3 / sum(s["ms_per_step"]), rel=1e-3)
    model, layout = s["model_bytes_per_step"], s["layout_bytes_per_step"]
    assert model["total"] == model["weights"] + model["kv_cache"] and model["kv_cache"] > 0
    assert layout == pytest.approx(model)  # one device: the layout reads the model's bytes
    assert s["pct_of_bandwidth_limit"] > 0
    assert s["pct_of_bandwidth_limit"] == pytest.approx(s["layout_pct_of_bandwidth_limit"])
    assert ("HBM" if cuda else "CPU memcpy") in s["read_bandwidth_measured_as"]
    assert "tokens/s" in r.stdout and "% of 1 x" in r.stdout
    # The default chunk (8192) holds the 1024-token prompt: one call, timed warm after a warm-up
    # of the same prompt; FLOPs per the formula in ModelArgs.prefill_flops.
    assert s["prefill"] == "real" and s["prefill_chunk"] == 8192
    assert s["prefill_warmup_len"] == 1024 and s["prefill_warmup_s"] > 0 and s["prefill_s"] > 0
    assert s["prefill_tflops_per_gpu"] == pytest.approx(s["prefill_flops"] / s["prefill_s"] / 1e12)
    assert "real, 1 call:" in r.stdout and "first call" in r.stdout
    assert s["largest_context_len"] > 1024
    assert (s["torch"], s["triton"]) == (torch.__version__, triton.__version__)
    assert f"largest context that fits tp=1 sp=1 on this device: {s['largest_context_len']:,} " \
        "tokens" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="on a CUDA machine each of the 2 ranks needs its own GPU")
def test_torchrun_sequence_parallel_with_checkpoint_and_text_prompt(tmp_path):
    args = ModelArgs(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16,
                     intermediate_size=96, vocab_size=64, name="ckpt")
    write_checkpoint(tmp_path / "ckpt", args)
    r = _run(tmp_path, f"model.checkpoint={tmp_path / 'ckpt'}", "prompt='hello world the cache'",
             "gen_len=4", "batch=2", "parallel.sp=2", nproc=2)
    assert r.returncode == 0, r.stderr
    run_dir, s = _summary(tmp_path)
    assert {"rank0.log", "rank1.log"} <= {p.name for p in run_dir.iterdir()}
    assert (s["world_size"], s["sp"], s["prompt_len"], s["batch"]) == (2, 2, 4, 2)
    assert isinstance(s["text"], str) and len(s["tokens"]) == 4
    assert r.stdout.count("run directory") == 1  # the console shows rank 0 only


def test_run_that_cannot_fit_stops_with_needed_vs_available(tmp_path):
    r = _run(tmp_path, "memory_gb=0.01")
    assert r.returncode != 0
    assert "not enough memory: this run needs about" in r.stderr
    assert "has 0.01 GiB available" in r.stderr
    assert "Traceback" in r.stderr  # errors are not swallowed
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert "not enough memory" in (run_dir / "rank0.log").read_text()


def test_profile_writes_the_kernel_table(tmp_path):
    r = _run(tmp_path, "profile=true", "context_len=64", "gen_len=4")
    assert r.returncode == 0, r.stderr
    run_dir, _ = _summary(tmp_path)
    table = (run_dir / "profile_rank0.txt").read_text()
    assert "3 eager decode steps at position 67" in table
    rows = [line for line in table.splitlines()[4:] if line.strip() and not line.startswith("-")]
    assert "Name" in table and len(rows) >= 5, table  # a real per-op table, not a stub
    assert "profile of 3 eager decode steps" in r.stdout


def test_chunked_prefill_run(tmp_path):
    """prefill_chunk splits the prompt (300 = 2 x 128 + 44); the warm-up prefill runs one full
    chunk and one as long as the last (128 + 44 positions)."""
    r = _run(tmp_path, "context_len=300", "prefill_chunk=128", "gen_len=4")
    assert r.returncode == 0, r.stderr
    _, s = _summary(tmp_path)
    assert (s["prefill"], s["prefill_chunk"], s["prompt_len"]) == ("real", 128, 300)
    assert s["prefill_warmup_len"] == 172 and s["prefill_s"] > 0
    assert "real, 3 chunks of 128:" in r.stdout and "warm-up prefill of 172 positions" in r.stdout


def test_bad_prefill_options_fail_before_running(tmp_path):
    r = _run(tmp_path, "prefill_chunk=-5")
    assert r.returncode != 0 and "prefill_chunk must be a positive integer" in r.stderr
    r = _run(tmp_path, "prefill=fake")
    assert r.returncode != 0 and "prefill must be one of real, synthetic, got 'fake'" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="on a CUDA machine each of the 2 ranks needs its own GPU")
def test_torchrun_synthetic_cache_with_sequence_parallel(tmp_path):
    """prefill=synthetic: no prefill, the summary says so and times the fill instead; the model's
    bytes per step (the headline) are below what sp=2 reads (the weights on both ranks)."""
    r = _run(tmp_path, "prefill=synthetic", "context_len=5001", "gen_len=4", "parallel.sp=2",
             nproc=2)
    assert r.returncode == 0, r.stderr
    _, s = _summary(tmp_path)
    assert s["prefill"] == "synthetic (random KV cache)" and s["prompt_len"] == 5001
    assert s["prefill_s"] is None and s["prefill_tokens_per_s"] is None
    assert s["prefill_tflops_per_gpu"] is None and s["synthetic_fill_s"] > 0
    assert "prefill     synthetic (random KV cache): no prefill, 5001 positions" in r.stdout
    model, layout = s["model_bytes_per_step"], s["layout_bytes_per_step"]
    assert layout["kv_cache"] == pytest.approx(model["kv_cache"])
    assert layout["weights"] == pytest.approx(2 * model["weights"], rel=1e-3)
    assert s["layout_pct_of_bandwidth_limit"] > s["pct_of_bandwidth_limit"] > 0
    assert "largest context that fits tp=1 sp=2" in r.stdout


def test_transformers_qwen2_checkpoint_with_yarn_gives_its_tokens(tmp_path):
    """A Qwen2 checkpoint with YaRN in the transformers 4.x spelling (Qwen2.5's 128k setting),
    saved by transformers with a tokenizer, decodes from a text prompt to transformers' greedy
    tokens (one process; the CPU runs fp32)."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the run is bf16: tokens may differ from fp32 transformers")
    ckpt = tmp_path / "qwen"
    save_hf_model(ckpt, model_type="qwen2", spelling="4.x", max_position_embeddings=4,
                  rope={"rope_type": "yarn", "factor": 4.0})
    write_tokenizer(ckpt)
    text = "hello world the cache is long and fast"
    prompt = torch.tensor([[WORDS.index(w) for w in text.split()]])
    want, _ = hf_greedy(load_hf_model(ckpt), prompt, 6)
    r = _run(tmp_path, f"model.checkpoint={ckpt}", f"prompt='{text}'", "gen_len=6")
    assert r.returncode == 0, r.stderr
    _, s = _summary(tmp_path)
    assert (s["model"], s["prompt_len"]) == ("qwen", 8)
    assert s["tokens"] == want[0].tolist()
    assert s["rope_scaling"] == "yarn (factor 4, original 4 positions, attention factor 1.139)"
    assert "rope scaling yarn (factor 4" in r.stdout


def test_fp8_kv_cache_run_counts_its_bytes(tmp_path):
    """kv_cache_dtype=fp8_e4m3, synthetic cache then a real chunked prefill: summary.json records
    the cache's dtype, and the limit counts 1 byte per K/V element plus its scales (the model's
    bytes: (1 + 4 / head_dim) / element size of the model-dtype cache's per position: float32 on
    the CPU, bfloat16 on a GPU)."""
    base = ("context_len=300", "gen_len=4")
    runs = {}
    for name, extra in (("f32", ()), ("fp8", ("kv_cache_dtype=fp8_e4m3",)),
                        ("fp8-chunked", ("kv_cache_dtype=fp8_e4m3", "prefill_chunk=128"))):
        out = tmp_path / name
        out.mkdir()
        r = _run(out, *base, "prefill=synthetic" if name != "fp8-chunked" else "prefill=real",
                 *extra)
        assert r.returncode == 0, r.stderr
        runs[name] = _summary(out)[1]
    dense, fp8 = runs["f32"], runs["fp8"]
    elem = {"float32": 4, "bfloat16": 2, "float16": 2}[dense["kv_cache_dtype"]]
    assert fp8["kv_cache_dtype"] == "float8_e4m3fn"
    D = 32  # configs/decode.yaml's tiny model
    want = dense["model_bytes_per_step"]["kv_cache"] * (1 + 4 / D) / elem
    assert fp8["model_bytes_per_step"]["kv_cache"] == pytest.approx(want)
    assert fp8["layout_bytes_per_step"]["kv_cache"] == pytest.approx(want)
    mem = fp8["memory_estimate_bytes"]["kv_cache"]
    assert mem < dense["memory_estimate_bytes"]["kv_cache"] * 1.2 / elem
    assert fp8["largest_context_len"] > dense["largest_context_len"]
    assert runs["fp8-chunked"]["prefill"] == "real" and len(runs["fp8-chunked"]["tokens"]) == 4
    r = _run(tmp_path / "f32", "kv_cache_dtype=int8")  # stops before running, naming the field
    assert r.returncode != 0 and "kv_cache_dtype must be one of auto, fp8_e4m3" in r.stderr
