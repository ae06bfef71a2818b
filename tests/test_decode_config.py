"""configs/decode.yaml and the model presets compose; bad configs and runs that cannot fit fail
with messages that state the numbers."""

import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from longctx.config import ModelArgs, check_chunk, check_decode_config
from longctx.parallel.memory import (CUDA_RESERVE, GiB, check_memory, estimate_memory,
                                     fitting_layouts, largest_context)
from longctx.parallel.mesh import ParallelDims

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PRESETS = sorted(p.stem for p in (CONFIGS / "model").glob("*.yaml"))


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("decode", overrides=list(overrides))


def test_presets_exist():
    assert {"tiny", "codellama34b", "llama2_7b", "llama3_8b", "llama3_1_8b", "llama3_1_70b",
            "qwen2_5_32b"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_every_model_preset_composes(name):
    cfg = _compose(f"+model={name}", "parallel.tp=2")
    assert cfg.model.name == name and cfg.parallel.tp == 2
    check_decode_config(cfg)
    args = ModelArgs.from_config(cfg.model)
    # The preset replaces the whole default (tiny) node: its keys and nothing else.
    preset = OmegaConf.load(CONFIGS / "model" / f"{name}.yaml")
    assert OmegaConf.to_container(cfg.model) == OmegaConf.to_container(preset)
    assert args.name == name


def test_default_model_is_the_tiny_preset():
    assert OmegaConf.to_container(_compose().model) == OmegaConf.to_container(
        OmegaConf.load(CONFIGS / "model" / "tiny.yaml"))


def test_codellama34b_has_the_published_hyperparameters():
    a = ModelArgs.from_config(_compose("+model=codellama34b").model)
    assert (a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.intermediate_size,
            a.vocab_size, a.rope_theta, a.norm_eps) == (48, 8192, 64, 8, 128, 22016, 32000, 1e6, 1e-5)
    assert round(a.num_params() / 1e9, 1) == 33.7


@pytest.mark.parametrize("name,shape,billions", [
    ("llama3_1_8b", (32, 4096, 32, 8, 128, 14336, 128256, 5e5, 1e-5), 8.03),
    ("llama3_1_70b", (80, 8192, 64, 8, 128, 28672, 128256, 5e5, 1e-5), 70.55),
    ("qwen2_5_32b", (64, 5120, 40, 8, 128, 27648, 152064, 1e6, 1e-6), 32.76),
])
def test_long_context_presets_have_the_published_hyperparameters(name, shape, billions):
    """Shapes and parameter counts of the published checkpoints (Qwen2.5's with its q/k/v
    biases), and the RoPE scaling of their 128k context."""
    from longctx.rope import RopeScaling

    a = ModelArgs.from_config(_compose(f"+model={name}").model)
    assert (a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.intermediate_size,
            a.vocab_size, a.rope_theta, a.norm_eps) == shape
    assert round(a.num_params() / 1e9, 2) == billions
    if name.startswith("llama"):
        assert not a.qkv_bias and a.rope_scaling == RopeScaling(
            "llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0)
    else:  # YaRN x4 of 32768 positions, as the Qwen2.5 model card sets it
        s = a.rope_scaling
        assert a.qkv_bias and (s.rope_type, s.factor, s.original_max_position_embeddings) == (
            "yarn", 4.0, 32768)
        assert a.num_params() - a.qkv_bias_params() * a.n_layers == ModelArgs.from_config(
            {**_compose(f"+model={name}").model, "qkv_bias": False}).num_params()


@pytest.mark.parametrize("override,match", [
    ("gen_len=1", r"gen_len must be an integer >= 2, got 1"),
    ("batch=0", r"batch must be an integer >= 1, got 0"),
    ("context_len=-3", r"context_len must be an integer >= 1, got -3"),
    ("dtype=fp8", r"dtype must be auto or one of .*, got 'fp8'"),
    ("sampling.top_p=0", r"sampling.top_p must be in \(0, 1\], got 0"),
    ("sampling.temperature=-1", r"sampling.temperature must be >= 0"),
    ("memory_gb=-2", r"memory_gb must be a positive number"),
    ("prompt=hello", r"prompt needs model.checkpoint"),
    ("prefill=fake", r"prefill must be one of real, synthetic, got 'fake'"),
    ("prefill_chunk=-8", r"prefill_chunk must be a positive integer .*null / 0 .*got -8"),
    ("prefill_chunk=1.5", r"prefill_chunk must be a positive integer .*got 1.5"),
    ("prefill_chunk=true", r"prefill_chunk must be a positive integer .*got True"),
    ("kv_cache_smoothing=yes", r"kv_cache_smoothing must be true or false, got 'yes'"),
])
def test_bad_run_config(override, match):
    with pytest.raises(ValueError, match=match):
        check_decode_config(_compose(override))


def test_prefill_options():
    cfg = _compose()
    assert (cfg.prefill, cfg.prefill_chunk) == ("real", 8192)
    for ok in ("prefill_chunk=null", "prefill_chunk=0", "prefill_chunk=1", "prefill=synthetic"):
        check_decode_config(_compose(ok))


def test_prefill_chunk_must_split_evenly_under_sp_only():
    """One validator: any positive chunk without sequence parallelism, a multiple of 2 sp with it
    (and a synthetic prefill, which runs no chunk, takes any)."""
    assert check_chunk(8192, 4) == 8192 and check_chunk(0, 4) is None and check_chunk(None) is None
    assert check_chunk(7) == 7 and check_chunk(7, sp=1) == 7
    with pytest.raises(ValueError, match=r"prefill_chunk \(100\) must be a multiple of 2 x "
                                         r"parallel.sp \(8\)"):
        check_chunk(100, 4)
    with pytest.raises(ValueError, match=r"prefill_chunk must be a positive integer .*got -1"):
        check_chunk(-1, 4)
    check_decode_config(_compose("prefill_chunk=7"))
    check_decode_config(_compose("prefill_chunk=7", "prefill=synthetic", "parallel.sp=2"))


def test_unknown_model_keys_are_rejected():
    with pytest.raises(ValueError, match=r"unknown model config key\(s\): model.rope_thetaa "
                                         r"\(model.rope_theta\?\)"):
        check_decode_config(_compose("+model.rope_thetaa=5e5"))
    with pytest.raises(ValueError, match=r"model.rope_thetaa"):
        ModelArgs.from_config(dict(_compose().model, rope_thetaa=5e5))
    assert ModelArgs.from_config(_compose().model).name == "tiny"  # checkpoint: a known key


def test_bad_model_and_parallel_config():
    tiny = ModelArgs.from_config(_compose().model)
    with pytest.raises(ValueError, match=r"parallel.tp \(2\) x parallel.sp \(3\) = 6 must equal "
                                         r"the world size \(4"):
        ParallelDims(2, 3, 4)
    with pytest.raises(ValueError, match=r"parallel.sp must be a positive integer, got 0"):
        ParallelDims(1, 0, 1)
    with pytest.raises(ValueError, match=r"model.n_heads \(4\) must be divisible by parallel.tp \(8\)"):
        ParallelDims(8, 1, 8).check_model(tiny)
    odd_kv = ModelArgs(n_layers=1, dim=96, n_heads=6, n_kv_heads=3, head_dim=16,
                       intermediate_size=64, vocab_size=64)
    with pytest.raises(ValueError, match=r"parallel.tp \(2\) must divide model.n_kv_heads \(3\) "
                                         r"or be a multiple of it"):
        ParallelDims(2, 1, 2).check_model(odd_kv)
    ParallelDims(4, 1, 4).check_model(ModelArgs(  # tp > KV heads: replicated, allowed
        n_layers=1, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=64,
        vocab_size=64))
    with pytest.raises(ValueError, match=r"model.head_dim must be a multiple of 8 in \[16, 256\], got 12"):
        ModelArgs(n_layers=1, dim=96, n_heads=8, n_kv_heads=2, intermediate_size=64, vocab_size=64)
    assert ModelArgs(n_layers=1, dim=96, n_heads=4, n_kv_heads=2, intermediate_size=64,
                     vocab_size=64).head_dim == 24  # Phi-3's 96 and others: any multiple of 8
    with pytest.raises(ValueError, match=r"model.n_heads \(6\) must be a multiple of model.n_kv_heads \(4\)"):
        ModelArgs(n_layers=1, dim=96, n_heads=6, n_kv_heads=4, head_dim=16, intermediate_size=64,
                  vocab_size=64)
    with pytest.raises(ValueError, match=r"the model config lacks model.vocab_size"):
        ModelArgs.from_config({"n_layers": 1, "dim": 64, "n_heads": 4, "n_kv_heads": 4,
                               "intermediate_size": 64})


def test_memory_check_states_needed_available_and_layouts_that_fit():
    args = ModelArgs.from_config(_compose("+model=codellama34b").model)
    kw = dict(batch=1, prompt_len=65536, max_seq_len=65536 + 128, dtype=torch.bfloat16,
              device_type="cuda")
    est = estimate_memory(args, tp=1, sp=1, **kw)
    # 33.7B bf16 parameters; 48 layers x 2 x 8 KV heads x 128 x 2 bytes = 192 KiB per position.
    assert abs(est.weights / 1e9 - 2 * 33.74) < 0.1
    assert est.kv_cache == 2 * 48 * (65536 + 128) * 8 * 128 * 2
    with pytest.raises(ValueError) as e:
        check_memory(args, tp=1, sp=1, available=int(80 * GiB), where="cuda:0", **kw)
    msg = str(e.value)
    assert f"needs about {est.total / GiB:.2f} GiB per device" in msg
    assert "but cuda:0 has 80.00 GiB available" in msg
    assert "parallel.tp=2 parallel.sp=1" in msg and "--nproc_per_node=2" in msg
    assert check_memory(args, tp=4, sp=2, available=int(80 * GiB), where="cuda:0", **kw).total < 80 * GiB
    with pytest.raises(ValueError, match="No tp x sp layout up to 64 devices fits"):
        check_memory(args, tp=1, sp=1, available=GiB, where="cuda:0", **kw)


H200 = int(139 * GiB)  # what one H200 has free for a run


def _codellama():
    return ModelArgs.from_config(_compose("+model=codellama34b").model)


def test_chunked_prefill_bounds_the_activations():
    """CodeLlama-34B at batch 8 x 32k on one H200 needs ~167 GiB unchunked,
    mostly prefill activations; in chunks of 8192 it fits. Activations no longer grow with
    the context (on CUDA), and without a prefill (synthetic cache) they are a decode step's."""
    args = _codellama()
    kw = dict(tp=1, sp=1, batch=8, prompt_len=32768, max_seq_len=32768 + 64,
              dtype=torch.bfloat16, device_type="cuda")
    whole, chunked = estimate_memory(**kw, args=args), estimate_memory(**kw, args=args,
                                                                       prefill_chunk=8192)
    assert 160 * GiB < whole.total < 170 * GiB
    assert chunked.total < H200 and chunked.weights + chunked.kv_cache < 112 * GiB
    assert chunked.activations < whole.activations / 3.9  # 8192 of 32768 positions per call
    assert chunked.reserve == CUDA_RESERVE and chunked.kv_cache == whole.kv_cache
    for c in (None, 0, 32768, 100000):  # a chunk of at least the prompt: one call
        assert estimate_memory(**kw, args=args, prefill_chunk=c) == whole
    # (chunks of 16384 would need ~140 GiB)
    with pytest.raises(ValueError, match=r"needs about 167.*prefill_chunk=8192 would fit this "
                                         r"layout \(about 126.\d\d GiB per device\)"):
        check_memory(args, available=H200, where="cuda:0", **kw)
    check_memory(args, available=H200, where="cuda:0", prefill_chunk=8192, **kw)
    long = dict(kw, batch=1, prompt_len=1 << 20, max_seq_len=(1 << 20) + 64, prefill_chunk=8192)
    short = dict(long, prompt_len=65536, max_seq_len=65536 + 64)
    assert estimate_memory(args, **long).activations == estimate_memory(args, **short).activations
    synthetic = estimate_memory(args, **dict(long, prompt_len=0))
    assert synthetic.activations < 0.01 * GiB
    # The RoPE tables: cos and sin, float32 [max_seq_len, head_dim].
    assert synthetic.rope == 2 * ((1 << 20) + 64) * 128 * 4
    # Under sp, a later chunk gathers its queries: more per rank than the first chunk alone.
    sp_kw = dict(long, tp=1, sp=2)
    one_chunk = estimate_memory(args, **dict(sp_kw, prompt_len=8192))
    assert estimate_memory(args, **sp_kw).activations > one_chunk.activations


def test_layout_suggestions_use_the_chunked_estimate():
    """256k tokens of CodeLlama-34B on H200s: unchunked, one GPU is refused and layouts of
    several are suggested; in chunks of 8192 one GPU fits."""
    args = _codellama()
    kw = dict(batch=1, prompt_len=262144, max_seq_len=262144 + 64, dtype=torch.bfloat16,
              device_type="cuda")
    assert fitting_layouts(args, H200, **kw)[0][:2] != (1, 1)
    assert fitting_layouts(args, H200, prefill_chunk=8192, **kw)[0][:2] == (1, 1)
    with pytest.raises(ValueError, match=r"Layouts that fit: parallel.tp=1 parallel.sp=2 .*"
                                         r"prefill_chunk=16384 would fit this layout"):
        check_memory(args, tp=1, sp=1, available=H200, where="cuda:0", **kw)


@pytest.mark.parametrize("tp,sp,target", [(1, 1, 350_000), (2, 1, 1_048_576), (1, 2, 700_000)])
@pytest.mark.parametrize("synthetic", [False, True])
def test_largest_context(tp, sp, target, synthetic):
    """The largest context that fits is the largest whose estimate fits (the next does not); on
    H200s it meets the targets (350k tokens on one, 1M at tp=2, 700k at sp=2), and is within 5%
    of (memory - weights - reserve) / KV bytes per token: with chunks, weights and KV cache set
    it."""
    args = _codellama()
    kw = dict(tp=tp, sp=sp, batch=1, dtype=torch.bfloat16, device_type="cuda")
    n = largest_context(args, available=H200, gen_len=64, prefill_chunk=8192, synthetic=synthetic,
                        **kw)
    assert n >= target

    def total(ctx):
        return estimate_memory(args, prompt_len=0 if synthetic else ctx, max_seq_len=ctx + 64,
                               prefill_chunk=8192, **kw).total

    assert total(n) <= H200 < total(n + 1)
    est = estimate_memory(args, prompt_len=0, max_seq_len=0, **kw)
    limit = (H200 - est.weights - est.reserve) / (args.kv_bytes_per_token(2) / (tp * sp))
    assert 0.95 * limit <= n <= limit
    # Nothing fits: 0. On a CPU the reference attention's scores limit the prefill.
    assert largest_context(args, available=GiB, gen_len=64, **kw) == 0
    tiny = ModelArgs.from_config(_compose().model)
    cpu = dict(kw, dtype=torch.float32, device_type="cpu")
    assert largest_context(tiny, available=GiB, gen_len=8, prefill_chunk=1024, **cpu) > \
        largest_context(tiny, available=GiB, gen_len=8, **cpu)


def test_memory_estimate_counts_qkv_biases_and_the_dynamic_rope_rebuild():
    import dataclasses

    qwen = ModelArgs.from_config(_compose("+model=qwen2_5_32b").model)
    kw = dict(tp=2, sp=1, batch=1, prompt_len=0, max_seq_len=131072, dtype=torch.bfloat16,
              device_type="cuda")
    est = estimate_memory(qwen, **kw)
    no_bias = estimate_memory(dataclasses.replace(qwen, qkv_bias=False), **kw)
    # Per rank at tp=2: 20 query and 4 KV heads of 128, bf16, in each of 64 layers.
    assert est.weights - no_bias.weights == 64 * (20 + 2 * 4) * 128 * 2
    assert est.rope == 2 * 131072 * 128 * 4 and est.activations < est.rope
    # Dynamic NTK rebuilds the tables before a long prompt: 3.5 tables beside the two in use.
    dynamic = dataclasses.replace(qwen, rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    assert estimate_memory(dynamic, **kw).activations == est.rope * 7 // 4


def test_readme_decode_commands_compose_as_written():
    """Every launch/decode.py command of the README, split as a shell splits it, is a valid Hydra
    command line (a prompt with parentheses needs Hydra's quotes inside the shell's)."""
    import shlex

    readme = (CONFIGS.parent / "README.md").read_text()
    lines = [ln.split("#")[0] for ln in readme.splitlines() if "launch/decode.py" in ln
             and ln.lstrip().startswith(("python", "torchrun"))]
    assert any("quicksort" in ln for ln in lines)
    for line in lines:
        words = shlex.split(re.sub(r"<[^>]*>", "/ckpt", line))  # <hf llama/qwen2 dir>
        overrides = words[words.index("launch/decode.py") + 1:]
        cfg = _compose(*overrides)
        if "quicksort" in line:
            assert cfg.prompt == "def quicksort(xs):" and cfg.model.checkpoint == "/ckpt"
