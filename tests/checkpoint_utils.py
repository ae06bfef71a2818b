"""Write a small Hugging Face-format Llama checkpoint (without transformers): config.json,
model.safetensors and a word-level tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from longctx.config import ModelArgs
from longctx.parallel.build import build_model
from longctx.weights import RandomWeights, checkpoint_tensors

WORDS = ["<unk>", "hello", "world", "the", "cache", "is", "long", "and", "fast"]


def write_checkpoint(path: Path, args: ModelArgs, seed: int = 0) -> None:
    """The model that RandomWeights(seed) gives, saved under Hugging Face's names."""
    # Dependencies of longctx; importorskip only for machines that install it with --no-deps.
    pytest.importorskip("safetensors", reason="safetensors is not installed here")
    pytest.importorskip("tokenizers", reason="tokenizers is not installed here")
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

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
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
