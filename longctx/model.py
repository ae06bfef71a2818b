"""Llama decoder (with Qwen2's q/k/v biases as an option) with a static KV cache: prefill
through `longctx.attention`, decode through `longctx.decode`. RoPE, scaled or not, reads the
cos/sin tables of `longctx.ops.rope_tables`.

The model holds no parallel code: longctx.parallel slices its weights, adds collectives and swaps
its KV cache class after it is built (as gpt-fast and torchtitan do). Module and parameter names
mirror Hugging Face's LlamaForCausalLM without the `model.` prefix, so checkpoints load by name.

    model = Transformer(args)                    # or on the meta device, then load weights
    model.setup_caches(batch=2, max_seq_len=4096)
    logits = model.prefill(tokens, torch.arange(S), chunk=1024)  # [B, V] float32, last position
    logits = model.decode_step(next_tokens, torch.full((B,), S))  # [B, V] float32

Chunked prefill: the prompt goes through the model `chunk` positions at a time; each chunk's
queries attend, causally by absolute position, to the keys that the chunks before it left in the
KV cache and to its own. The logits are those of the unchunked prefill (up to rounding) while the
activations are bounded by batch x chunk positions instead of the whole prompt.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from longctx.attention import attention
from longctx.config import ModelArgs, check_chunk
from longctx.decode import decode
from longctx.fp8 import FP8, check_fp8_device, head_major, key_major_v, kv_means
from longctx.ops import (linear, linear_silu_mul, rms_norm, rope_, rope_store_kv, rope_tables,
                         store_fp8)
from longctx.rope import attention_factor


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
    dtype float8_e4m3fn: an fp8 cache, with k_scale, v_scale [B, S_max, Hkv] float32 (longctx.fp8:
    one scale per token and KV head, written by the kernels that store K/V); k_cache and the
    scales stored head-major, v_cache key-major (strided views: longctx.fp8.head_major,
    key_major_v); else both None. smooth (fp8 only): K and V are stored less their means over the
    first prefill chunk of each sequence, k_mean, v_mean [B, Hkv, D] float32 (longctx.fp8's
    smoothing; zeros until a prefill from position 0, so a cache filled otherwise is plain);
    else both None.
    longctx.parallel replaces this class to shard the cache by position.
    """

    def __init__(self, batch: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, smooth: bool = True) -> None:
        super().__init__()
        shape = (batch, max_seq_len, n_kv_heads, head_dim)
        fp8 = dtype == FP8
        # An fp8 cache in the decode kernel's faster layouts, still indexed [B, S_max, Hkv, D]:
        # K and the scales head-major, V key-major (longctx.fp8.head_major, key_major_v);
        # zero-filled, as a key-major V's reads past a length need.
        k = head_major(shape, dtype, device) if fp8 else torch.zeros(shape, dtype=dtype,
                                                                     device=device)
        v = key_major_v(shape, device) if fp8 else torch.zeros(shape, dtype=dtype, device=device)
        self.register_buffer("k_cache", k, persistent=False)
        self.register_buffer("v_cache", v, persistent=False)
        for name in ("k_scale", "v_scale"):
            self.register_buffer(name, head_major(shape[:3], torch.float32, device) if fp8
                                 else None, persistent=False)
        for name in ("k_mean", "v_mean"):
            self.register_buffer(name, torch.zeros((batch, n_kv_heads, head_dim), device=device)
                                 if fp8 and smooth else None, persistent=False)

    def means(self) -> dict:
        """The smoothing means as keyword arguments (k_mean, v_mean), or none."""
        return {} if self.k_mean is None else dict(k_mean=self.k_mean, v_mean=self.v_mean)

    def store(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v [B, L, Hkv, D] at slots [start, start + L) (quantized for an fp8 cache; a
        smoothed one takes its means from the chunk at slot 0, a new sequence's first)."""
        end = start + k.shape[1]
        if self.k_scale is None:
            self.k_cache[:, start:end] = k
            self.v_cache[:, start:end] = v
            return
        if start == 0 and self.k_mean is not None:
            self.take_means(k, v)
        store_fp8(self.k_cache[:, start:end], self.k_scale[:, start:end], k, self.k_mean)
        store_fp8(self.v_cache[:, start:end], self.v_scale[:, start:end], v, self.v_mean)

    def take_means(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Set the smoothing means from a new sequence's first chunk k/v [B, L, Hkv, D]."""
        self.k_mean.copy_(kv_means(k))
        self.v_mean.copy_(kv_means(v))

    def attend(self, q: torch.Tensor, end: int,
               **kw) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`attention(q, k, v, **kw)` over slots [0, end) of this cache (with an fp8 cache's
        scales and means)."""
        scales = {} if self.k_scale is None else dict(k_scale=self.k_scale[:, :end],
                                                      v_scale=self.v_scale[:, :end])
        return attention(q, self.k_cache[:, :end], self.v_cache[:, :end], **kw, **scales,
                         **self.means())

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
        self.store(start, k, v)
        return self.attend(q, end, causal=True, q_start=start)

    def step_indices(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a decode step at positions input_pos [B] int64 writes its token (cache slot [B]
        int64) and how many entries it then attends to (cache_seqlens [B] int32). The same for
        every layer, so the model computes it once per step."""
        return input_pos, (input_pos + 1).to(torch.int32)

    def prefix_slots(self, context_len: int) -> int:
        """How many slots, from slot 0, hold the positions [0, context_len): all of them here."""
        return context_len

    def fill_random_(self, context_len: int, k_std: torch.Tensor, v_std: torch.Tensor,
                     generator: torch.Generator) -> None:
        """Fill the slots of positions [0, context_len) (`prefix_slots`) with N(0, std^2) values,
        std per KV head (k_std, v_std [Hkv] float32), drawn from `generator` on the cache's
        device in its dtype: a KV cache as if a prompt of context_len positions had run. An fp8
        cache is filled through the same draw in float32, quantized (longctx.fp8.quantize_kv),
        its smoothing means zero (the draw's own mean)."""
        n = self.prefix_slots(context_len)
        if n > self.k_cache.shape[1]:
            raise ValueError(f"context_len {context_len} needs {n} cache slots, but the cache "
                             f"holds {self.k_cache.shape[1]}")
        if self.k_mean is not None:
            self.k_mean.zero_()
            self.v_mean.zero_()
        for cache, scale, std in ((self.k_cache, self.k_scale, k_std),
                                  (self.v_cache, self.v_scale, v_std)):
            for b in range(cache.shape[0]):  # [n, Hkv, D]: contiguous, so one fast fill each
                if scale is None:
                    part = cache[b, :n]
                    part.normal_(generator=generator)
                    part.mul_(std.to(device=part.device, dtype=part.dtype)[:, None])
                    continue
                piece = 1 << 16  # fp8: drawn in float32 pieces, each quantized into the cache
                for i in range(0, n, piece):
                    m = min(piece, n - i)
                    part = torch.empty((1, m, *cache.shape[2:]), device=cache.device)
                    part.normal_(generator=generator).mul_(std.to(part.device)[:, None])
                    store_fp8(cache[b:b + 1, i:i + m], scale[b:b + 1, i:i + m], part)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               step: tuple[torch.Tensor, torch.Tensor],
               rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor], return_lse: bool = False):
        """Rotate q [B, Hq, D] and k [B, Hkv, D] in place, write each sequence's new k/v at its
        slot and run `decode` over the first cache_seqlens entries, with (slot, cache_seqlens) =
        step_indices(input_pos). rope = (cos, sin tables [max_seq_len, D] float32, positions [B]
        int64); the kernel that stores k and v rotates them (`rope_store_kv`: one launch).
        -> o [B, Hq, D] (and lse [B, Hq] with return_lse)."""
        slot, cache_seqlens = step
        scales = {} if self.k_scale is None else dict(k_scale=self.k_scale, v_scale=self.v_scale)
        scales.update(self.means())
        rope_store_kv(q, k, v, *rope, self.k_cache, self.v_cache, slot, **scales)
        return decode(q, self.k_cache, self.v_cache, cache_seqlens=cache_seqlens,
                      return_lse=return_lse, **scales)


class Linear(nn.Linear):
    """nn.Linear (bias off by default) whose batch-1 product runs longctx.ops.linear (a Triton
    GEMV on CUDA, the bias added in its epilogue). Forward hooks (tensor parallelism's
    all-reduce) apply as to any nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class FusedLinear(Linear):
    """One Linear whose output rows are several checkpoint tensors stacked, e.g. q, k and v: at
    batch 1 one large GEMV reads the weights closer to the bandwidth limit than a few small
    ones. `parts` maps each tensor's name (relative to this module's parent) to its rows here;
    longctx.weights fills each part from its own tensors (weight, and bias if any: its entries
    are stacked the same way), and tensor parallelism slices each part and updates the row
    counts."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
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
                                               "v_proj": args.n_kv_heads * D}, bias=args.qkv_bias)
        self.o_proj = Linear(args.n_heads * D, args.dim)
        self.kv_cache: KVCache | None = None

    def kv_std(self, norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The std per KV head [Hkv] float32 of the k and v this layer's projections produce.

        The projection's input is input_layernorm's output g * n (norm_weight g [dim]), n of unit
        mean square; for n with independent unit-variance entries, output row j of W has
        variance sum_i (W[j, i] g[i])^2, and mean square that plus the square of its bias, if
        any. A head's std is the root of the mean over its D rows; RoPE rotates pairs of rows
        within a head, which keeps that mean (the caller scales k's by RoPE's attention factor).
        For RandomWeights (entries N(0, std^2), norm weights 1) this is std * sqrt(dim): 0.02 *
        sqrt(8192) = 1.81 for CodeLlama-34B."""
        D, hq, hkv = self.head_dim, self.n_heads, self.n_kv_heads
        w = self.qkv_proj.weight[hq * D:].float() * norm_weight.float()  # k, v rows [2 hkv D, dim]
        var = w.pow(2).sum(dim=1)
        if self.qkv_proj.bias is not None:
            var = var + self.qkv_proj.bias[hq * D:].float().pow(2)
        var = var.view(2, hkv, D).mean(dim=-1)
        return var[0].sqrt(), var[1].sqrt()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                input_pos: torch.Tensor, step: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """x [B, S, dim]; rope = (cos, sin tables [max_seq_len, D], positions [B, S]); step: the
        KV cache's step_indices when decoding (S = 1), None for a prefill chunk."""
        B, S, _ = x.shape
        hq, hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(B, S, hq + 2 * hkv, D)
        if step is not None:
            # RoPE of q and k happens in the kernel that stores k and v (KVCache.decode).
            q, k, v = qkv[:, 0].split([hq, hkv, hkv], dim=1)
            cos, sin, pos = rope
            o = self.kv_cache.decode(q, k, v, step, (cos, sin, pos[:, 0]))[:, None]
        else:
            # One RoPE launch rotates q and k: they are adjacent heads of the fused projection.
            rope_(qkv[:, :, :hq + hkv], *rope)
            q, k, v = qkv.split([hq, hkv, hkv], dim=2)
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


# (batch, max_seq_len, n_kv_heads, head_dim, dtype, device, smooth=...) -> a layer's cache.
CacheFactory = Callable[..., KVCache]


def chunk_spans(length: int, chunk: int | None) -> list[tuple[int, int]]:
    """[start, end) pieces of a `length`-position prompt, each `chunk` long but the last (which
    may be shorter); chunk None / 0: one piece (none for length 0)."""
    chunk = check_chunk(chunk) or max(length, 1)
    return [(s, min(s + chunk, length)) for s in range(0, length, chunk)]


class Transformer(nn.Module):
    """Llama / Qwen2 decoder. Build, load weights, `setup_caches`, then `prefill` and
    `decode_step`."""

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
        self.rope_prompt_len = 0  # the prompt length the RoPE tables were made for (dynamic NTK)

    def setup_caches(self, batch: int, max_seq_len: int,
                     kv_cache_dtype: torch.dtype | None = None, kv_smoothing: bool = True) -> None:
        """Allocate every layer's KV cache and the RoPE tables on the weights' device and dtype;
        the KV cache in kv_cache_dtype if given (torch.float8_e4m3fn: an fp8 cache with scales,
        longctx.fp8, smoothed by each sequence's first prefill chunk's means unless
        kv_smoothing is False)."""
        w = self.lm_head.weight
        hd = self.args.head_dim
        if kv_cache_dtype == FP8:
            check_fp8_device(w.device, "kv_cache_dtype fp8_e4m3")
        for layer in self.layers:
            attn = layer.self_attn
            attn.kv_cache = self.make_cache(batch, max_seq_len, attn.n_kv_heads, hd,
                                            kv_cache_dtype or w.dtype, w.device,
                                            smooth=kv_smoothing)
        cos, sin = rope_tables(max_seq_len, hd, self.args.rope_theta, w.device,
                               self.args.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_seq_len, D] float32
        self.register_buffer("rope_sin", sin, persistent=False)
        self.max_seq_len, self.rope_prompt_len = max_seq_len, 0

    def rope_for_prompt(self, input_pos: torch.Tensor) -> None:
        """Before a prefill call over positions input_pos [P] int64 (all its chunks): with
        dynamic NTK scaling, whose frequencies transformers takes from the length of each forward
        call, rewrite the RoPE tables (in place) so that the call's positions rotate as one
        transformers call ending at the same position would, and later positions as decoded
        tokens (longctx.rope). Other RoPE types: nothing (no host read)."""
        s = self.args.rope_scaling
        if s is None or s.rope_type != "dynamic":
            return
        end = int(input_pos[-1]) + 1
        # Up to the original length every row is unscaled, as for no prompt at all.
        end = end if end > s.original_max_position_embeddings else 0
        if end != self.rope_prompt_len:
            cos, sin = rope_tables(self.max_seq_len, self.args.head_dim, self.args.rope_theta,
                                   self.rope_cos.device, s, prompt_len=end)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
            self.rope_prompt_len = end

    def _run(self, tokens: torch.Tensor, pos: torch.Tensor, input_pos: torch.Tensor,
             decoding: bool) -> torch.Tensor:
        """tokens [B, S] at absolute positions pos [B, S] (for RoPE) -> the final norm's output
        of the last row, [B, dim] (the only row the LM head reads)."""
        x = self.embed_tokens(tokens)
        rope = (self.rope_cos, self.rope_sin, pos)
        step = self.layers[0].self_attn.kv_cache.step_indices(input_pos) if decoding else None
        delta = None
        for layer in self.layers:
            x, delta = layer(x, delta, rope, input_pos, step)
        return self.norm(x[:, -1], delta[:, -1])[1]  # n_layers >= 1: delta is set

    def prefill_hidden(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """One prefill call: tokens [B, S] int64 at absolute positions input_pos [S] int64 (their
        K/V enter the cache; the cache must hold every position before them) -> the final norm's
        output [B, dim] of the last row. `prefill` without the LM head, for one chunk."""
        if self.max_seq_len == 0:
            raise RuntimeError("call setup_caches() before prefill()")
        return self._run(tokens, input_pos[None].expand(tokens.shape[0], -1), input_pos,
                         decoding=False)

    def prefill(self, tokens: torch.Tensor, input_pos: torch.Tensor,
                chunk: int | None = None) -> torch.Tensor:
        """tokens [B, S] int64 at absolute positions input_pos [S] int64 -> logits [B, V]
        float32 of the last row (the next-token distribution after them).

        chunk: positions per call (`chunk_spans`); None or 0: all S at once. Each chunk attends to
        the cache that the earlier ones filled, so any chunk size gives the same logits (up to
        rounding); only the last chunk's last row goes through the LM head.
        """
        if tokens.dim() != 2 or tokens.shape[1] == 0 or input_pos.shape != tokens.shape[1:]:
            raise ValueError(f"tokens must be [B, S] with S >= 1 and input_pos [S], got "
                             f"{tuple(tokens.shape)} and {tuple(input_pos.shape)}")
        self.rope_for_prompt(input_pos)
        for start, end in chunk_spans(tokens.shape[1], chunk):
            h = self.prefill_hidden(tokens[:, start:end], input_pos[start:end])
        return self.lm_head(h).float()

    @torch.no_grad()
    def fill_random_cache(self, context_len: int, seed: int) -> None:
        """Instead of a prefill (decode benchmarks at long contexts): every layer's KV cache holds
        seeded random values at positions [0, context_len), drawn on the cache's device in its
        dtype, N(0, std^2) with the std per KV head that the layer's own k/v projections give
        (`Attention.kv_std`). Decoding continues at position context_len. Seeded by (seed,
        layer): pass a seed per rank where the ranks' caches should differ."""
        if self.max_seq_len == 0:
            raise RuntimeError("call setup_caches() before fill_random_cache()")
        if not isinstance(context_len, int) or context_len < 1 or context_len >= self.max_seq_len:
            raise ValueError(f"context_len must be in [1, {self.max_seq_len}) (the cache holds "
                             f"{self.max_seq_len} positions and decoding needs one), got {context_len!r}")
        # Decoding continues as after a prompt of context_len positions.
        self.rope_for_prompt(torch.tensor([context_len - 1]))
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            gen = torch.Generator(device=attn.kv_cache.k_cache.device)
            gen.manual_seed((seed * 1_000_003 + i) % 2**63)
            k_std, v_std = attn.kv_std(layer.input_layernorm.weight)
            k_std = k_std * attention_factor(self.args.rope_scaling)  # RoPE scales k (YaRN)
            attn.kv_cache.fill_random_(context_len, k_std, v_std, gen)

    def decode_step(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """tokens [B] int64 at positions input_pos [B] int64 -> logits [B, V] float32.
        Reads and writes only fixed buffers: capturable in a CUDA graph."""
        return self.lm_head(self._run(tokens[:, None], input_pos[:, None], input_pos,
                                      decoding=True)).float()
