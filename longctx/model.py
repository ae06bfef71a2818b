"""Llama decoder with a static KV cache: prefill through `longctx.attention`, decode through
`longctx.decode`.

The model holds no parallel code: longctx.parallel slices its weights, adds collectives and swaps
its KV cache class after it is built (as gpt-fast and torchtitan do). Module and parameter names
mirror Hugging Face's LlamaForCausalLM without the `model.` prefix, so checkpoints load by name.

    model = Transformer(args)                    # or on the meta device, then load weights
    model.setup_caches(batch=2, max_seq_len=4096)
    logits = model.prefill(tokens, torch.arange(S))             # [B, V] float32, last position
    logits = model.decode_step(next_tokens, torch.full((B,), S))  # [B, V] float32
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from longctx.attention import attention
from longctx.config import ModelArgs
from longctx.decode import decode
from longctx.ops import linear, linear_silu_mul, rms_norm, rope_, rope_tables, store_kv


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None):
        """norm(x); with `add`, (x + add, norm(x + add)): the residual add fused in front."""
        return rms_norm(x, self.weight, self.eps, add)


class KVCache(nn.Module):
    """One layer's static KV cache and the attention over it.

    k_cache, v_cache: [B, S_max, Hkv, D]; position p of sequence b lives at [b, p]. Preallocated
    once (the decode step reads and writes fixed buffers, so it can be captured in a CUDA graph).
    longctx.parallel replaces this class to shard the cache by position.
    """

    def __init__(self, batch: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        shape = (batch, max_seq_len, n_kv_heads, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                input_pos: torch.Tensor) -> torch.Tensor:
        """Store k/v and attend causally over the cache up to the chunk's end.

        q [B, S, Hq, D], k/v [B, S, Hkv, D] (rotated); input_pos [S] int64, contiguous positions
        (a chunk after earlier ones attends to them too). Returns o [B, S, Hq, D].
        """
        start = int(input_pos[0])  # prefill runs eagerly; one host read per layer
        end = start + q.shape[1]
        if end > self.k_cache.shape[1]:
            raise ValueError(f"prefill up to position {end} exceeds the KV cache capacity "
                             f"({self.k_cache.shape[1]})")
        self.k_cache[:, start:end] = k
        self.v_cache[:, start:end] = v
        return attention(q, self.k_cache[:, :end], self.v_cache[:, :end], causal=True, q_start=start)

    def step_indices(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a decode step at positions input_pos [B] int64 writes its token (cache slot [B]
        int64) and how many entries it then attends to (cache_seqlens [B] int32). The same for
        every layer, so the model computes it once per step."""
        return input_pos, (input_pos + 1).to(torch.int32)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               step: tuple[torch.Tensor, torch.Tensor], return_lse: bool = False):
        """Write each sequence's new k/v [B, Hkv, D] at its slot and run `decode` over the first
        cache_seqlens entries, with (slot, cache_seqlens) = step_indices(input_pos).
        q [B, Hq, D] -> o [B, Hq, D] (and lse [B, Hq] with return_lse)."""
        slot, cache_seqlens = step
        store_kv(self.k_cache, self.v_cache, k, v, slot)
        return decode(q, self.k_cache, self.v_cache, cache_seqlens=cache_seqlens,
                      return_lse=return_lse)


class Linear(nn.Linear):
    """nn.Linear without bias whose batch-1 product runs longctx.ops.linear (a Triton GEMV on
    CUDA). Forward hooks (tensor parallelism's all-reduce) apply as to any nn.Linear."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class FusedLinear(Linear):
    """One Linear (no bias) whose output rows are several checkpoint tensors stacked, e.g. q, k
    and v: at batch 1 one large GEMV reads the weights closer to the bandwidth limit than a few
    small ones. `parts` maps each tensor's name (relative to this module's parent) to its rows
    here; longctx.weights fills each part from its own tensor, and tensor parallelism slices
    each part and updates the row counts."""

    def __init__(self, in_features: int, parts: dict[str, int]) -> None:
        super().__init__(in_features, sum(parts.values()))
        self.parts = dict(parts)


class GateUpLinear(FusedLinear):
    """The MLP's gate and up projections stacked (parts gate_proj, then up_proj, equal sizes);
    forward returns silu(gate) * up: at batch 1 one GEMV with the activation in its epilogue."""

    def __init__(self, in_features: int, intermediate: int) -> None:
        super().__init__(in_features, {"gate_proj": intermediate, "up_proj": intermediate})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_silu_mul(x, self.weight)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        D = self.head_dim = args.head_dim
        # Head counts of this module: tensor parallelism lowers them when it slices the weights.
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.qkv_proj = FusedLinear(args.dim, {"q_proj": args.n_heads * D,
                                               "k_proj": args.n_kv_heads * D,
                                               "v_proj": args.n_kv_heads * D})
        self.o_proj = Linear(args.n_heads * D, args.dim)
        self.kv_cache: KVCache | None = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                input_pos: torch.Tensor, step: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """x [B, S, dim]; rope = (cos, sin tables [max_seq_len, D], positions [B, S]); step: the
        KV cache's step_indices when decoding (S = 1), None for a prefill chunk."""
        B, S, _ = x.shape
        hq, hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        # One RoPE launch rotates q and k: they are adjacent heads of the fused projection.
        qkv = self.qkv_proj(x).view(B, S, hq + 2 * hkv, D)
        rope_(qkv[:, :, :hq + hkv], *rope)
        q, k, v = qkv.split([hq, hkv, hkv], dim=2)
        if step is not None:
            o = self.kv_cache.decode(q[:, 0], k[:, 0], v[:, 0], step)[:, None]
        else:
            o = self.kv_cache.prefill(q, k, v, input_pos)
        return self.o_proj(o.reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(args.dim, args.intermediate_size)
        self.down_proj = Linear(args.intermediate_size, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, delta, rope, input_pos, step) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream x and the previous block's output delta (None before the first block)
        -> (x + delta + attention, this block's MLP output): each residual add is fused into the
        norm that follows it."""
        x, h = self.input_layernorm(x, delta) if delta is not None else (x, self.input_layernorm(x))
        x, h = self.post_attention_layernorm(x, self.self_attn(h, rope, input_pos, step))
        return x, self.mlp(h)


CacheFactory = Callable[[int, int, int, int, torch.dtype, torch.device], KVCache]


class Transformer(nn.Module):
    """Llama decoder. Build, load weights, `setup_caches`, then `prefill` and `decode_step`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # Weights come from longctx.weights; `_weight` skips nn.Embedding's default init (which
        # on the meta device costs seconds of imports).
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim,
                                         _weight=torch.empty(args.vocab_size, args.dim))
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = Linear(args.dim, args.vocab_size)
        # (batch, max_seq_len, n_kv_heads, head_dim, dtype, device) -> a layer's cache.
        self.make_cache: CacheFactory = KVCache
        self.max_seq_len = 0

    def setup_caches(self, batch: int, max_seq_len: int) -> None:
        """Allocate every layer's KV cache and the RoPE tables on the weights' device and dtype."""
        w = self.lm_head.weight
        hd = self.args.head_dim
        for layer in self.layers:
            attn = layer.self_attn
            attn.kv_cache = self.make_cache(batch, max_seq_len, attn.n_kv_heads, hd, w.dtype,
                                            w.device)
        cos, sin = rope_tables(max_seq_len, hd, self.args.rope_theta, w.device)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_seq_len, D] float32
        self.register_buffer("rope_sin", sin, persistent=False)
        self.max_seq_len = max_seq_len

    def _run(self, tokens: torch.Tensor, pos: torch.Tensor, input_pos: torch.Tensor,
             decoding: bool) -> torch.Tensor:
        """tokens [B, S] at absolute positions pos [B, S] (for RoPE) -> the final norm's output
        [B, S, dim]."""
        x = self.embed_tokens(tokens)
        rope = (self.rope_cos, self.rope_sin, pos)
        step = self.layers[0].self_attn.kv_cache.step_indices(input_pos) if decoding else None
        delta = None
        for layer in self.layers:
            x, delta = layer(x, delta, rope, input_pos, step)
        return self.norm(x, delta)[1] if delta is not None else self.norm(x)

    def prefill(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] int64 at absolute positions input_pos [S] int64 -> logits [B, V]
        float32 of the last row (the next-token distribution after the chunk)."""
        if self.max_seq_len == 0:
            raise RuntimeError("call setup_caches() before prefill()")
        x = self._run(tokens, input_pos[None].expand(tokens.shape[0], -1), input_pos, decoding=False)
        return self.lm_head(x[:, -1]).float()

    def decode_step(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """tokens [B] int64 at positions input_pos [B] int64 -> logits [B, V] float32.
        Reads and writes only fixed buffers: capturable in a CUDA graph."""
        x = self._run(tokens[:, None], input_pos[:, None], input_pos, decoding=True)
        return self.lm_head(x[:, 0]).float()
