"""Where a model's weights come from: seeded random tensors, or a Hugging Face checkpoint.

Both fill a built model parameter by parameter on its own device and dtype. Under tensor
parallelism a parameter holds a slice of the full tensor; the `ShardPlan` that longctx.parallel
returns says which, so each rank reads (or keeps) only its slice.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from longctx.config import ModelArgs


@dataclass(frozen=True)
class Shard:
    """A parameter holds full.narrow(dim, start, length) of a full tensor with full.shape[dim] ==
    full_size."""

    dim: int
    start: int
    length: int
    full_size: int


ShardPlan = dict[str, Shard]  # parameter name -> its slice; parameters not named are whole


class WeightSource(Protocol):
    def read(self, name: str, full_shape: tuple[int, ...], shard: Shard | None,
             out: torch.Tensor) -> None:
        """Copy parameter `name` (full shape `full_shape`), sliced by `shard`, into `out`."""


class RandomWeights:
    """Deterministic N(0, std) weights (norm weights 1), drawn on the parameter's device in its
    dtype. A tensor is drawn in blocks of BLOCK rows (or columns, for the row-parallel o_proj and
    down_proj), each from a generator seeded by (seed, name, block): a rank draws only the blocks
    its shard overlaps, and every tp/sp layout gets the same values, so parallel runs compute the
    same model as one device."""

    BLOCK = 64

    def __init__(self, seed: int = 0, std: float = 0.02) -> None:
        self.seed, self.std = seed, std

    def read(self, name: str, full_shape: tuple[int, ...], shard: Shard | None,
             out: torch.Tensor) -> None:
        if name.endswith("norm.weight"):
            out.fill_(1.0)
            return
        # Block along the dim that tensor parallelism slices; any other slice is still correct.
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
        lo, hi = 0, full_shape[dim]
        if shard is not None and shard.dim == dim:
            lo, hi = shard.start, shard.start + shard.length
        gen = torch.Generator(device=out.device)
        base = self.seed * 1_000_003 + zlib.crc32(name.encode())
        blocks = []
        for b in range(lo // self.BLOCK, -(-hi // self.BLOCK)):
            shape = list(full_shape)
            shape[dim] = min(self.BLOCK, full_shape[dim] - b * self.BLOCK)
            gen.manual_seed((base * 1_000_003 + b) % 2**63)
            blocks.append(torch.empty(shape, dtype=out.dtype, device=out.device)
                          .normal_(0.0, self.std, generator=gen))
        region = torch.cat(blocks, dim).narrow(dim, lo % self.BLOCK, hi - lo)
        if shard is not None and shard.dim != dim:
            region = region.narrow(shard.dim, shard.start, shard.length)
        out.copy_(region)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"model.checkpoint: {path} is not readable JSON ({e})") from e


class HFCheckpoint:
    """A Hugging Face Llama or Qwen2 checkpoint directory: config.json (ModelArgs.from_hf_config
    says what it accepts), model.safetensors or shards listed in model.safetensors.index.json,
    and (for text prompts) tokenizer.json. Tensors are read with safetensors' get_slice, so a
    rank reads only its slice from disk; with tie_word_embeddings the LM head reads the
    embedding."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        config = self.path / "config.json"
        if not config.is_file():
            raise ValueError(f"model.checkpoint: {self.path} has no config.json")
        self.tied = bool(_read_json(config).get("tie_word_embeddings", False))
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"model.checkpoint: {index} has no weight_map")
            self.files = {k: self.path / f for k, f in weight_map.items()}
        elif (self.path / "model.safetensors").is_file():
            with self._open(self.path / "model.safetensors") as f:
                self.files = {k: self.path / "model.safetensors" for k in f.keys()}
        else:
            raise ValueError(f"model.checkpoint: {self.path} has neither model.safetensors nor "
                             "model.safetensors.index.json")

    def args(self) -> ModelArgs:
        return ModelArgs.from_hf_config(self.path / "config.json")

    def tokenizer(self):
        """The checkpoint's `tokenizers.Tokenizer` (from tokenizer.json)."""
        from tokenizers import Tokenizer

        path = self.path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model.checkpoint: {self.path} has no tokenizer.json for the prompt")
        return Tokenizer.from_file(str(path))

    def _open(self, file: Path):
        from safetensors import safe_open

        try:
            return safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # safetensors' own error type (corrupt, truncated) or OSError
            raise ValueError(f"model.checkpoint: {file} is not a readable safetensors file "
                             f"({e})") from e

    def read(self, name: str, full_shape: tuple[int, ...], shard: Shard | None,
             out: torch.Tensor) -> None:
        key = name if name == "lm_head.weight" else "model." + name
        if key == "lm_head.weight" and key not in self.files and self.tied:
            key = "model.embed_tokens.weight"
        if key not in self.files:
            raise ValueError(f"model.checkpoint: {self.path} has no tensor {key}")
        with self._open(self.files[key]) as f:
            sl = f.get_slice(key)
            shape = tuple(sl.get_shape())
            if shape != tuple(full_shape):
                raise ValueError(f"model.checkpoint: {key} has shape {shape} but the model "
                                 f"expects {tuple(full_shape)}")
            index = [slice(None)] * len(shape)
            if shard is not None:
                index[shard.dim] = slice(shard.start, shard.start + shard.length)
            out.copy_(sl[tuple(index)])


def checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters by checkpoint tensor name (Hugging Face's, without `model.`): a
    fused projection (a module with `parts`, e.g. qkv_proj of q_proj, k_proj, v_proj) gives one
    view per part, its rows in order. Views share the parameters' storage."""
    tensors = {}
    for mod_name, module in model.named_modules():
        parts = getattr(module, "parts", None)
        for p_name, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if parts is None:
                tensors[name] = p
                continue
            if sum(parts.values()) != p.shape[0]:
                raise ValueError(f"{name}: parts cover {sum(parts.values())} rows of {p.shape[0]}")
            parent = mod_name.rpartition(".")[0]
            for part, view in zip(parts, p.split(list(parts.values()), dim=0)):
                tensors[f"{parent}.{part}.{p_name}"] = view
    return tensors


@torch.no_grad()
def load_weights(model: nn.Module, source: WeightSource, plan: ShardPlan | None = None) -> None:
    """Fill every parameter of `model` (already on its device, e.g. after to_empty) from
    `source`, tensor by checkpoint name (`checkpoint_tensors`); `plan` gives the slices of
    tensor-parallel tensors."""
    plan = plan or {}
    for name, out in checkpoint_tensors(model).items():
        shard = plan.get(name)
        full_shape = list(out.shape)
        if shard is not None:
            full_shape[shard.dim] = shard.full_size
        source.read(name, tuple(full_shape), shard, out)
