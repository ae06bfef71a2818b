"""Small Hugging Face-format checkpoints for the tests: a Llama written without transformers
(config.json, model.safetensors and a word-level tokenizer.json), or a Llama / Qwen2 saved by
transformers itself (any RoPE scaling, in its 4.x or 5.x config spelling), with the greedy
generation of transformers as the reference."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from longctx.config import ModelArgs
from longctx.parallel.build import build_model
from longctx.weights import RandomWeights, checkpoint_tensors

WORDS = ["<unk>", "hello", "world", "the", "cache", "is", "long", "and", "fast"]


def _transformers_major() -> int:
    try:
        from importlib.metadata import version

        return int(version("transformers").split(".")[0])
    except Exception:  # not installed: the tests that need it skip themselves
        return 0


# longctx reads YaRN's parameters as transformers 5 does; 4.x releases read an explicit
# original_max_position_embeddings otherwise (4.4x: the correction range from
# max_position_embeddings; 4.5x: the factor from their ratio). Without that key all agree.
YARN_AS_IN_TRANSFORMERS_5 = pytest.mark.skipif(
    0 < _transformers_major() < 5, reason="transformers 4.x reads YaRN's "
    "original_max_position_embeddings differently from transformers 5, which longctx follows")


def write_checkpoint(path: Path, args: ModelArgs, seed: int = 0) -> None:
    """The model that RandomWeights(seed) gives, saved under Hugging Face's names (a plain
    Llama: no RoPE scaling, no biases; save_hf_model writes the others)."""
    if args.rope_scaling is not None or args.qkv_bias:
        raise ValueError("write_checkpoint writes plain Llama checkpoints; use save_hf_model")
    # Dependencies of longctx; importorskip only for machines that install it with --no-deps.
    pytest.importorskip("safetensors", reason="safetensors is not installed here")
    pytest.importorskip("tokenizers", reason="tokenizers is not installed here")
    from safetensors.torch import save_file

    model = build_model(args, weights=RandomWeights(seed), device="cpu", dtype=torch.float32,
                        batch=1, max_seq_len=1)
    tensors = {(n if n == "lm_head.weight" else "model." + n): p.contiguous()
               for n, p in checkpoint_tensors(model).items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": args.n_layers, "hidden_size": args.dim,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim, "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size, "rope_theta": args.rope_theta,
        "rms_norm_eps": args.norm_eps, "tie_word_embeddings": False}))
    write_tokenizer(path)


def write_tokenizer(path: Path) -> None:
    """A word-level tokenizer.json over WORDS (ids 0-8)."""
    pytest.importorskip("tokenizers", reason="tokenizers is not installed here")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def save_hf_model(path: Path, model_type: str = "llama", rope: dict | None = None,
                  spelling: str | None = None, seed: int = 0, max_shard_size: str = "50GB",
                  bias_std: float = 0.5, **config):
    """A small random LlamaForCausalLM / Qwen2ForCausalLM saved by transformers' save_pretrained
    into `path` and loaded back from there (the reference reads the file longctx reads).

    rope: transformers' rope parameters ({"rope_type": ..., ...}, without rope_theta; None:
    plain RoPE). spelling: config.json as the installed transformers wrote it (None), or
    rewritten as transformers 4.x writes it ("4.x": rope_theta at the top, rope_scaling with
    "type") or as 5.x does ("5.x": rope_parameters, rope_theta inside). Only transformers 5
    reads both.
    config: overrides of the default sizes (2 layers, 64 wide, 4/2 heads of 16, vocab 128).
    Weights N(0, 0.08^2), norms 1 + N(0, 0.3^2), q/k/v biases (Qwen2) N(0, bias_std^2): large
    enough that a misplaced one shows."""
    transformers = pytest.importorskip("transformers", reason="the reference (test extra)")
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
               tie_word_embeddings=False, max_position_embeddings=256, rope_theta=5e5)
    cfg.update(config)
    Config, Model = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                     "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[model_type]
    torch.manual_seed(seed)
    # rope_theta and rope_scaling: transformers 4.x's keywords, which 5.x takes too (and fills
    # in: a copy).
    hf = Model(Config(**cfg, rope_scaling=dict(rope) if rope else None)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn_like(p) * bias_std)
            else:  # norms too, so that loading them matters
                p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.08) + ("norm" in name))
    hf.save_pretrained(path, safe_serialization=True, max_shard_size=max_shard_size)
    if spelling is None:
        return load_hf_model(path)
    # Whichever spelling the installed transformers wrote, rewritten in the one asked for.
    c = json.loads((path / "config.json").read_text())
    params = dict(c.pop("rope_parameters", None) or c.pop("rope_scaling", None) or {})
    c.pop("rope_scaling", None)
    theta = params.pop("rope_theta", c.pop("rope_theta", None))
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if spelling == "4.x":
        c["rope_theta"] = theta
        c["rope_scaling"] = None if kind == "default" else {"type": kind, **params}
    elif spelling == "5.x":
        c.pop("rope_theta", None)
        c["rope_parameters"] = {"rope_type": kind, **params, "rope_theta": theta}
    else:
        raise ValueError(f"spelling must be '4.x' or '5.x', got {spelling!r}")
    (path / "config.json").write_text(json.dumps(c))
    return load_hf_model(path)


def load_hf_model(path: Path):
    """transformers' model of the checkpoint in `path`, fresh (dynamic NTK RoPE keeps state across
    calls in transformers: each reference generation starts from a fresh load)."""
    transformers = pytest.importorskip("transformers", reason="the reference (test extra)")
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


@torch.no_grad()
def hf_greedy(hf, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' greedy generate() of `steps` tokens after prompt [B, P] (no end-of-sequence
    token, so exactly `steps`) -> (tokens [B, steps] int64, the logits [steps, B, V] float32
    each was picked from)."""
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id, config.pad_token_id = None, 0
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config,
                      max_new_tokens=steps, do_sample=False, output_logits=True,
                      return_dict_in_generate=True)
    return out.sequences[:, prompt.shape[1]:], torch.stack(out.logits).float()
