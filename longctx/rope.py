"""Rotary position embedding: the inverse frequencies of plain RoPE and of the scalings that
long-context checkpoints use ("linear", "dynamic" NTK, "llama3", "yarn"), as transformers computes
them (modeling_rope_utils, the same float32 operations in the same order), and the parsing of a
checkpoint's `rope_scaling` / `rope_parameters`. longctx.ops.rope_tables turns them into the
cos/sin tables [max_seq_len, head_dim] float32 that the model and the kernels read.

"dynamic" is the one type whose frequencies depend on the sequence: transformers recomputes them
in each forward call whose last position p reaches beyond max_position_embeddings, from the
length p + 1, for every position of that call, while the keys already cached keep theirs. For a
prompt of P positions prefilled in one call and then decoded one token per call, position q is
thus rotated with the frequencies of length max(P, orig) if q < P and of length max(q + 1, orig)
if q >= P (orig = max_position_embeddings). The tables hold exactly that (`prompt_len` of
rope_tables), whatever the chunking of the prefill; the prompt is what the model's prefill call
was given (Transformer.rope_for_prompt).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

SCALINGS = ("linear", "dynamic", "llama3", "yarn")
# Parameters each type reads (transformers' names); anything else in the dict is refused.
_KEYS = {
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"},
}


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling, its parameters resolved (defaults filled in as transformers fills them).
    Build it from a checkpoint's dict with `from_dict`."""

    rope_type: str  # one of SCALINGS
    factor: float  # context extension factor
    # llama3 / yarn: the pretraining context length; dynamic: max_position_embeddings, the
    # length beyond which the base grows. None for linear.
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float = 32.0  # yarn: rotations bounding the extrapolated (unscaled) dimensions
    beta_slow: float = 1.0  # yarn: rotations bounding the interpolated (scaled) dimensions
    truncate: bool = True  # yarn: round the correction range outwards to whole dimensions
    attention_factor: float = 1.0  # yarn: cos and sin are multiplied by it (scores by its square)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None,
                  max_position_embeddings: int | None = None) -> RopeScaling | None:
        """From transformers' spelling: {"rope_type" (or 4.x "type"): ..., "factor": ..., ...}
        as in config.json's rope_scaling (4.x) or rope_parameters (5.x, without rope_theta,
        which is model.rope_theta here). None or type "default": plain RoPE (returns None).
        max_position_embeddings: the checkpoint's; dynamic needs it, llama3 and yarn default
        original_max_position_embeddings to it. ValueError naming the key for an unknown type, an
        unknown or missing key, or a bad value."""
        if not d:
            return None
        d = dict(d)
        rope_type = d.pop("rope_type", None) or d.pop("type", None) or "default"
        d.pop("type", None)
        if rope_type == "default":
            if d:
                raise ValueError(f"rope_scaling: plain RoPE (rope_type 'default') takes no "
                                 f"parameters, got {sorted(d)}")
            return None
        if rope_type not in SCALINGS:
            raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not supported (supported: "
                             f"default, {', '.join(SCALINGS)})")
        unknown = sorted(set(d) - _KEYS[rope_type])
        if unknown:
            raise ValueError(f"rope_scaling: {rope_type!r} does not take {', '.join(unknown)} "
                             f"(it takes {', '.join(sorted(_KEYS[rope_type]))})")

        def number(key: str, positive: bool = True) -> float:
            v = d.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (positive and v <= 0):
                raise ValueError(f"rope_scaling.{key} of {rope_type!r} must be a "
                                 f"{'positive ' if positive else ''}number, got {v!r}")
            return float(v)

        def length(v: Any, what: str) -> int:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{what} must be a positive integer for rope_type {rope_type!r}, "
                                 f"got {v!r}")
            return v

        if rope_type in ("linear", "dynamic"):
            orig = None
            if rope_type == "dynamic":
                orig = length(max_position_embeddings, "max_position_embeddings")
            return cls(rope_type, number("factor"), orig)
        orig = d.get("original_max_position_embeddings") or max_position_embeddings
        orig = length(orig, "rope_scaling.original_max_position_embeddings (or "
                            "max_position_embeddings)")
        if rope_type == "llama3":
            low, high = number("low_freq_factor"), number("high_freq_factor")
            if high <= low:
                raise ValueError(f"rope_scaling: llama3's high_freq_factor ({high}) must exceed "
                                 f"low_freq_factor ({low})")
            return cls(rope_type, number("factor"), orig, low_freq_factor=low,
                       high_freq_factor=high)
        # yarn. A factor left out is max_position_embeddings / original (transformers 5).
        if d.get("factor") is None and max_position_embeddings:
            d["factor"] = max_position_embeddings / orig
        factor = number("factor")
        if d.get("attention_factor") is not None:
            attention = number("attention_factor")
        elif d.get("mscale") and d.get("mscale_all_dim"):
            attention = float(_yarn_mscale(factor, number("mscale"))
                              / _yarn_mscale(factor, number("mscale_all_dim")))
        else:
            attention = _yarn_mscale(factor)
        # transformers reads `x or default` here: 0 / None mean the default.
        beta_fast = number("beta_fast") if d.get("beta_fast") else 32.0
        beta_slow = number("beta_slow") if d.get("beta_slow") else 1.0
        truncate = d.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(f"rope_scaling.truncate of 'yarn' must be true or false, got "
                             f"{truncate!r}")
        return cls(rope_type, factor, orig, beta_fast=beta_fast, beta_slow=beta_slow,
                   truncate=truncate, attention_factor=attention)


def describe(scaling: RopeScaling | None) -> str:
    """One line for reports: 'none', or e.g. 'llama3 (factor 8, original 8192 positions)'."""
    if scaling is None:
        return "none"
    parts = [f"factor {scaling.factor:g}"]
    if scaling.rope_type == "dynamic":
        parts.append(f"beyond {scaling.original_max_position_embeddings} positions")
    elif scaling.original_max_position_embeddings is not None:
        parts.append(f"original {scaling.original_max_position_embeddings} positions")
    if scaling.attention_factor != 1.0:
        parts.append(f"attention factor {scaling.attention_factor:.4g}")
    return f"{scaling.rope_type} ({', '.join(parts)})"


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term (0.1 ln s + 1, scaled by mscale; 1 for s <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by (YaRN's mscale; 1 otherwise): q and k each grow by it."""
    return 1.0 if scaling is None else scaling.attention_factor


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
             seq_len: torch.Tensor | None = None,
             device: torch.device | str | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies [head_dim / 2] float32 (rotate-half pairs (i, i + D/2)).

    Dynamic NTK scaling with `seq_len` [R] int64 (the lengths of R forward calls; each at
    least original_max_position_embeddings) -> [R, head_dim / 2]: the frequencies of each.
    Without seq_len "dynamic" gives the unscaled frequencies (a call within the original length).
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    if scaling is not None and scaling.rope_type == "dynamic" and seq_len is not None:
        # The new base from each length, in float32 as transformers computes it from a tensor.
        f, orig = scaling.factor, scaling.original_max_position_embeddings
        base = theta * ((f * seq_len.to(device) / orig) - (f - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base[:, None] ** exponent)
    inv = 1.0 / (theta ** exponent)
    if scaling is None or scaling.rope_type == "dynamic":
        return inv
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3(inv, scaling)
    return _yarn(head_dim, theta, scaling, inv.device)


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than orig / low_freq_factor are divided by factor, those
    shorter than orig / high_freq_factor kept, the band between blended smoothly."""
    orig, low, high = s.original_max_position_embeddings, s.low_freq_factor, s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > orig / low, inv / s.factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < orig / high) * ~(wavelen > orig / low)
    return torch.where(medium, blended, scaled)


def _yarn(head_dim: int, theta: float, s: RopeScaling, device: torch.device) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context are
    interpolated (frequency / factor), those that turn more than beta_fast times kept, a linear
    ramp between."""
    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return (head_dim * math.log(s.original_max_position_embeddings
                                    / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001  # a one-point ramp: a step
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    keep = 1 - ramp.to(device)  # 1: extrapolate (keep the frequency), 0: interpolate
    theta_pow = theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    return (1.0 / (s.factor * theta_pow)) * (1 - keep) + (1.0 / theta_pow) * keep
