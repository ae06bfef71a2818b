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

from longctx.fp8 import resolve_kv_cache_dtype
from longctx.rope import RopeScaling

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# real: the prompt runs through the model; synthetic: seeded random KV cache, no prefill.
PREFILL_MODES = ("real", "synthetic")
# Keys of a config's model node that are not ModelArgs fields.
MODEL_NODE_KEYS = ("checkpoint",)


@dataclass(frozen=True)
class ModelArgs:
    """Llama architecture: RMSNorm, rotary embeddings (optionally scaled), GQA attention, SwiGLU
    MLP, untied embedding and LM head, no biases but optionally on q, k and v (Qwen2). Validated
    on construction (ValueError naming the field)."""

    n_layers: int  # transformer blocks
    dim: int  # hidden size
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads; n_heads is a multiple (GQA, MQA)
    intermediate_size: int  # SwiGLU MLP hidden size
    vocab_size: int  # token ids are in [0, vocab_size)
    head_dim: int | None = None  # per-head size; None means dim // n_heads
    rope_theta: float = 10000.0  # rotary embedding base
    norm_eps: float = 1e-5  # RMSNorm epsilon
    # The context length the checkpoint was configured for (transformers' field): the length
    # beyond which "dynamic" scaling starts, the default original length of llama3 / yarn.
    max_position_embeddings: int | None = None
    # RoPE scaling in transformers' spelling ({"rope_type": "llama3", "factor": 8.0, ...}), parsed
    # into a longctx.rope.RopeScaling; None: plain RoPE.
    rope_scaling: RopeScaling | Mapping[str, Any] | None = None
    qkv_bias: bool = False  # the q, k and v projections have biases (Qwen2)
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
        # The attention kernels' range (longctx.checks.check_head_dim).
        if not isinstance(d, int) or isinstance(d, bool) or d < 16 or d > 256 or d % 8:
            raise ValueError(f"model.head_dim must be a multiple of 8 in [16, 256], got {d!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads ({self.n_heads}) must be a multiple of "
                             f"model.n_kv_heads ({self.n_kv_heads})")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ValueError(f"model.rope_theta ({self.rope_theta}) and model.norm_eps "
                             f"({self.norm_eps}) must be positive")
        m = self.max_position_embeddings
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"model.max_position_embeddings must be a positive integer or null, "
                             f"got {m!r}")
        if not isinstance(self.qkv_bias, bool):
            raise ValueError(f"model.qkv_bias must be true or false, got {self.qkv_bias!r}")
        if isinstance(self.rope_scaling, Mapping):
            try:
                scaling = RopeScaling.from_dict(self.rope_scaling, m)
            except ValueError as e:
                raise ValueError(f"model.{e}") from None
            object.__setattr__(self, "rope_scaling", scaling)
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"model.rope_scaling must be a mapping (transformers' spelling) or "
                             f"null, got {self.rope_scaling!r}")

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
        """From a Hugging Face config.json of a Llama or Qwen2 checkpoint (transformers 4.x
        spelling: rope_theta and rope_scaling; 5.x: rope_parameters). ValueError, naming the
        file and the field, for what the model does not implement: other architectures,
        activations or biases, partial rotary embeddings, sliding-window attention, RoPE types
        other than default, linear, dynamic, llama3 and yarn."""
        path = Path(path)
        c = json.loads(path.read_text())
        model_type = c.get("model_type")
        if model_type not in ("llama", "qwen2"):
            raise ValueError(f"{path}: model_type must be 'llama' or 'qwen2', got {model_type!r}")
        if c.get("mlp_bias") or c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: MLP biases and activations other than silu are not "
                             "supported")
        if model_type == "llama" and c.get("attention_bias"):
            raise ValueError(f"{path}: attention_bias (biases on q, k, v and o_proj) is not "
                             "supported; q/k/v biases alone are (model_type 'qwen2')")
        if model_type == "qwen2":
            _refuse_sliding_window(path, c)
        # As transformers reads it: rope_scaling (4.x) before rope_parameters (5.x); rope_theta
        # inside the dict before the top-level one.
        rope = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", c.get("rope_theta", 10000.0))
        partial = rope.pop("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"{path}: partial_rotary_factor {partial} (RoPE on part of each head) "
                             "is not supported")
        if "original_max_position_embeddings" in c and \
                rope.get("rope_type", rope.get("type")) in ("llama3", "yarn"):
            # Phi-3's spelling, which transformers prefers over the one in the dict.
            rope["original_max_position_embeddings"] = c["original_max_position_embeddings"]
        try:
            return cls(
                n_layers=c["num_hidden_layers"], dim=c["hidden_size"],
                n_heads=c["num_attention_heads"],
                n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
                head_dim=c.get("head_dim"), intermediate_size=c["intermediate_size"],
                vocab_size=c["vocab_size"], rope_theta=float(theta),
                norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=c.get("max_position_embeddings"), rope_scaling=rope or None,
                qkv_bias=model_type == "qwen2", name=path.parent.name,
            )
        except KeyError as e:
            raise ValueError(f"{path}: no {e.args[0]} field") from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def num_params(self) -> int:
        """Parameter count (embedding and LM head included, counted apart even where a
        checkpoint ties them: the model holds both)."""
        block = self._layer_matmul_params() + 2 * self.dim + self.qkv_bias_params()
        return self.n_layers * block + 2 * self.vocab_size * self.dim + self.dim

    def qkv_bias_params(self) -> int:
        """One block's q, k and v biases (0 without)."""
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim if self.qkv_bias else 0

    def _layer_matmul_params(self) -> int:
        """Weights of one block's matrix products (q, k, v, o, gate, up, down)."""
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        return attn + 3 * self.dim * self.intermediate_size

    def kv_bytes_per_token(self, element_size: float) -> float:
        """Bytes of one position's K and V over all layers and KV heads, at element_size bytes per
        element (an fp8 cache: 1 + its scales' 4 / head_dim, longctx.fp8.kv_bytes_per_element)."""
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

    def decode_bytes(self, batch: int, mean_len: float, element_size: int,
                     kv_element_size: float | None = None) -> dict[str, float]:
        """The model's own bytes per decode step, whatever the layout: every weight once (of the
        embedding table only the `batch` looked-up rows) and the KV cache of all KV heads once
        at `mean_len` positions, kv_element_size bytes per element (default element_size; an fp8
        cache's scales included). {"weights", "kv_cache", "total"}."""
        weights = (self.num_params() - self.vocab_size * self.dim + batch * self.dim) * element_size
        kv = batch * mean_len * self.kv_bytes_per_token(kv_element_size or element_size)
        return {"weights": float(weights), "kv_cache": float(kv), "total": float(weights + kv)}


def _refuse_sliding_window(path: Path, c: Mapping[str, Any]) -> None:
    """Qwen2's sliding-window attention, which the model does not implement: ValueError when it
    is on in any layer. transformers slides layer i when use_sliding_window is set, sliding_window
    is not null and layer_types[i] is "sliding_attention" (layer_types, when config.json lacks
    it: layers from max_window_layers on)."""
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    if window is None:
        return
    n = c.get("num_hidden_layers", 0)
    types = c.get("layer_types") or ["sliding_attention" if i >= c.get("max_window_layers", 28)
                                     else "full_attention" for i in range(n)]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding:
        raise ValueError(f"{path}: sliding-window attention (use_sliding_window with "
                         f"sliding_window={window}, in {len(sliding)} of {n} layers from layer "
                         f"{sliding[0]}) is not supported: every layer attends to the whole "
                         "context here. Checkpoints that set use_sliding_window: false (all "
                         "Qwen2.5 releases) load.")


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


# Tensor parallelism's sums (longctx.parallel.allreduce.make_all_reduce).
ALL_REDUCE_KINDS = ("auto", "push", "push_gemv", "nccl")


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
    resolve_kv_cache_dtype(cfg.get("kv_cache_dtype", "auto"), torch.float32)  # likewise
    if not isinstance(cfg.get("kv_cache_smoothing", True), bool):
        raise ValueError(f"kv_cache_smoothing must be true or false, got "
                         f"{cfg['kv_cache_smoothing']!r}")
    s = cfg["sampling"]
    if not isinstance(s["temperature"], (int, float)) or s["temperature"] < 0:
        raise ValueError(f"sampling.temperature must be >= 0 (0 = greedy), got {s['temperature']!r}")
    if not isinstance(s["top_p"], (int, float)) or not 0 < s["top_p"] <= 1:
        raise ValueError(f"sampling.top_p must be in (0, 1], got {s['top_p']!r}")
    if cfg["parallel"].get("all_reduce", "auto") not in ALL_REDUCE_KINDS:
        raise ValueError(f"parallel.all_reduce must be one of {', '.join(ALL_REDUCE_KINDS)}, "
                         f"got {cfg['parallel']['all_reduce']!r}")
    mem = cfg.get("memory_gb")
    if mem is not None and (not isinstance(mem, (int, float)) or mem <= 0):
        raise ValueError(f"memory_gb must be a positive number of GiB or null, got {mem!r}")
