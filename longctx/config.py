"""Model hyper-parameters (one dataclass; the named presets are configs/model/*.yaml) and the
validation of a decode run's config (configs/decode.yaml)."""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# real: the prompt runs through the model; synthetic: seeded random KV cache, no prefill.
PREFILL_MODES = ("real", "synthetic")
# Keys of a config's model node that are not ModelArgs fields.
MODEL_NODE_KEYS = ("checkpoint",)


@dataclass(frozen=True)
class ModelArgs:
    """Llama architecture: RMSNorm, rotary embeddings, GQA attention, SwiGLU MLP, untied
    embedding and LM head, no biases. Validated on construction (ValueError naming the field)."""

    n_layers: int  # transformer blocks
    dim: int  # hidden size
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads; n_heads is a multiple (GQA, MQA)
    intermediate_size: int  # SwiGLU MLP hidden size
    vocab_size: int  # token ids are in [0, vocab_size)
    head_dim: int | None = None  # per-head size; None means dim // n_heads
    rope_theta: float = 10000.0  # rotary embedding base
    norm_eps: float = 1e-5  # RMSNorm epsilon
    name: str = "custom"  # preset name, for reports

    def __post_init__(self) -> None:
        for f in ("n_layers", "dim", "n_heads", "n_kv_heads", "intermediate_size", "vocab_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"model.{f} must be a positive integer, got {v!r}")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"model.dim ({self.dim}) is not a multiple of model.n_heads "
                                 f"({self.n_heads}); set model.head_dim")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        d = self.head_dim
        # The attention kernels take power-of-two head sizes in [16, 256] (longctx.checks).
        if not isinstance(d, int) or d < 16 or d > 256 or d & (d - 1):
            raise ValueError(f"model.head_dim must be a power of two in [16, 256], got {d!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads ({self.n_heads}) must be a multiple of "
                             f"model.n_kv_heads ({self.n_kv_heads})")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ValueError(f"model.rope_theta ({self.rope_theta}) and model.norm_eps "
                             f"({self.norm_eps}) must be positive")

    @classmethod
    def check_keys(cls, node: Mapping[str, Any]) -> None:
        """A config's `model` node holds only ModelArgs fields and MODEL_NODE_KEYS: a misspelt
        field (`rope_thetaa`) would otherwise be dropped silently, leaving the default."""
        known = [f.name for f in dataclasses.fields(cls)] + list(MODEL_NODE_KEYS)
        unknown = [k for k in node if k not in known]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(str(k), known, n=1)
                hints.append(f"model.{k}" + (f" (model.{close[0]}?)" if close else ""))
            raise ValueError(f"unknown model config key(s): {', '.join(hints)}; the model node "
                             f"takes {', '.join(known)}")

    @classmethod
    def from_config(cls, node: Mapping[str, Any]) -> "ModelArgs":
        """From a config's `model` node (configs/model/*.yaml): its fields, and MODEL_NODE_KEYS
        (such as `checkpoint`), which are not fields; any other key raises ValueError."""
        cls.check_keys(node)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in node.items() if k in names}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in kwargs]
        if missing:
            raise ValueError(f"the model config lacks {', '.join('model.' + m for m in missing)}")
        return cls(**kwargs)

    @classmethod
    def from_hf_config(cls, path: str | Path) -> "ModelArgs":
        """From a Hugging Face Llama config.json (transformers 4.x or 5.x spelling)."""
        path = Path(path)
        c = json.loads(path.read_text())
        if c.get("model_type") != "llama":
            raise ValueError(f"{path}: model_type must be 'llama', got {c.get('model_type')!r}")
        # transformers 5 writes rope_parameters; 4.x wrote rope_theta and rope_scaling.
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{path}: rope scaling ({rope_type!r}) is not supported, only plain RoPE")
        if c.get("attention_bias") or c.get("mlp_bias") or c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: biases and activations other than silu are not supported")
        return cls(
            n_layers=c["num_hidden_layers"], dim=c["hidden_size"], n_heads=c["num_attention_heads"],
            n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            head_dim=c.get("head_dim"), intermediate_size=c["intermediate_size"],
            vocab_size=c["vocab_size"],
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            norm_eps=float(c.get("rms_norm_eps", 1e-6)), name=path.parent.name,
        )

    def num_params(self) -> int:
        """Parameter count (embedding and LM head included)."""
        return self.n_layers * (self._layer_matmul_params() + 2 * self.dim) \
            + 2 * self.vocab_size * self.dim + self.dim

    def _layer_matmul_params(self) -> int:
        """Weights of one block's matrix products (q, k, v, o, gate, up, down)."""
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        return attn + 3 * self.dim * self.intermediate_size

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of one position's K and V over all layers and KV heads."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * element_size

    def prefill_flops(self, batch: int, prompt_len: int) -> float:
        """FLOPs of a causal prefill of `batch` prompts of `prompt_len` positions from position 0
        (the model's own, whatever the layout): 2 x the blocks' matrix weights x tokens, plus the
        LM head on each sequence's last row, plus attention's 4 x layers x Hq x head_dim x the
        visible (query, key) pairs, P (P + 1) / 2 per sequence (QK^T and PV, 2 FLOPs a
        multiply-add each). Norms, RoPE and softmax are left out."""
        tokens = batch * prompt_len
        linear = 2 * tokens * self.n_layers * self._layer_matmul_params() \
            + 2 * batch * self.dim * self.vocab_size
        pairs = batch * prompt_len * (prompt_len + 1) / 2
        return float(linear + 4 * self.n_layers * self.n_heads * self.head_dim * pairs)

    def decode_bytes(self, batch: int, mean_len: float, element_size: int) -> dict[str, float]:
        """The model's own bytes per decode step, whatever the layout: every weight once (of the
        embedding table only the `batch` looked-up rows) and the KV cache of all KV heads once
        at `mean_len` positions. {"weights", "kv_cache", "total"}."""
        weights = (self.num_params() - self.vocab_size * self.dim + batch * self.dim) * element_size
        kv = batch * mean_len * self.kv_bytes_per_token(element_size)
        return {"weights": float(weights), "kv_cache": float(kv), "total": float(weights + kv)}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`dtype` config value -> torch dtype; 'auto' is bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def check_chunk(chunk: int | None, sp: int = 1) -> int | None:
    """A prefill chunk size (`prefill_chunk`): a positive int, or None / 0 for the whole prompt
    (returned as None); with sequence parallelism (sp > 1) a multiple of 2 sp, so that every
    chunk splits evenly in the ring's zigzag layout. ValueError naming prefill_chunk otherwise."""
    if not (chunk is None or (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 0)):
        raise ValueError(f"prefill_chunk must be a positive integer (positions per prefill call) "
                         f"or null / 0 for the whole prompt, got {chunk!r}")
    if chunk and sp > 1 and chunk % (2 * sp):
        raise ValueError(f"prefill_chunk ({chunk}) must be a multiple of 2 x parallel.sp "
                         f"({2 * sp}): each chunk is split in 2 sp equal pieces")
    return chunk or None


def check_decode_config(cfg: Mapping[str, Any]) -> None:
    """Validate the run fields of configs/decode.yaml (the model node is checked by ModelArgs,
    the parallel degrees by longctx.parallel.ParallelDims). ValueError states the numbers."""
    def positive_int(key: str, v: Any, least: int = 1) -> None:
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(f"{key} must be an integer >= {least}, got {v!r}")

    if cfg["prefill"] not in PREFILL_MODES:
        raise ValueError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {cfg['prefill']!r}")
    ModelArgs.check_keys(cfg["model"])
    check_chunk(cfg["prefill_chunk"])
    if cfg["prefill"] == "synthetic" and cfg.get("prompt") is not None:
        raise ValueError("prefill=synthetic fills the KV cache with random values for context_len "
                         "positions; it takes no prompt (set prompt=null)")
    if cfg.get("prompt") is None:
        positive_int("context_len", cfg["context_len"])
    elif not isinstance(cfg["prompt"], str) or not cfg["prompt"]:
        raise ValueError(f"prompt must be a non-empty string or null, got {cfg['prompt']!r}")
    elif not cfg["model"].get("checkpoint"):
        raise ValueError("prompt needs model.checkpoint: the text is tokenized with the "
                         "checkpoint's tokenizer.json")
    # One token comes from the prefill; at least one decode step is timed.
    positive_int("gen_len", cfg["gen_len"], least=2)
    positive_int("batch", cfg["batch"])
    resolve_dtype(cfg["dtype"], torch.device("cpu"))  # raises for an unknown name
    s = cfg["sampling"]
    if not isinstance(s["temperature"], (int, float)) or s["temperature"] < 0:
        raise ValueError(f"sampling.temperature must be >= 0 (0 = greedy), got {s['temperature']!r}")
    if not isinstance(s["top_p"], (int, float)) or not 0 < s["top_p"] <= 1:
        raise ValueError(f"sampling.top_p must be in (0, 1], got {s['top_p']!r}")
    mem = cfg.get("memory_gb")
    if mem is not None and (not isinstance(mem, (int, float)) or mem <= 0):
        raise ValueError(f"memory_gb must be a positive number of GiB or null, got {mem!r}")
