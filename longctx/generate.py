"""Generation: prefill a batch of prompts, then decode token by token from static buffers.

On CUDA the whole decode step (every layer, the collectives that parallelism added, sampling,
advancing the position) is captured once in a CUDA graph and replayed; the host never waits on a
token. Elsewhere the same step runs eagerly.

Tokens are picked by the model's `sampler` attribute when it has one, else by `sample`: a
callable (logits, temperature, top_p) -> [B] int64 over what the model's prefill and
decode_step return, giving the same tokens on every rank and capturable in a CUDA graph.
longctx.parallel sets it where those logits are a rank's vocabulary shard (tensor parallelism),
so the full vocabulary never has to be gathered for sampling.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from longctx.model import Transformer, chunk_spans


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0) -> torch.Tensor:
    """Next token per row of logits [B, V] float32 -> [B] int64.

    temperature 0 is greedy (argmax). Otherwise sample softmax(logits / temperature), restricted
    to the smallest set of tokens whose probability reaches top_p. Draws use the default
    generator through exponential noise (argmax(p / E), E ~ Exp(1), samples p): no host sync,
    capturable in a CUDA graph, identical on ranks seeded alike.
    """
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens ranked above it already reach top_p (the first stays).
        drop = sorted_p.cumsum(dim=-1) - sorted_p >= top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    noise = torch.empty_like(probs).exponential_(1)
    return (probs / noise).argmax(dim=-1)


# (logits, temperature, top_p) -> next token per row [B] int64; `sample` is the default.
Sampler = Callable[[torch.Tensor, float, float], torch.Tensor]


def model_sampler(model: Transformer) -> Sampler:
    """The model's `sampler` attribute if it has one, else `sample`."""
    return getattr(model, "sampler", None) or sample


class DecodeStep:
    """One decode step over static buffers: feed `tokens` [B] at `pos` [B], sample the next
    token into column `col` of `out` [B, gen_len], advance. On CUDA it is captured in a graph.

    `first_nonfinite` [1] int64 is the first column whose token came from logits holding NaN or
    inf (gen_len while none did): kept on the device, so a step never waits for the host; read
    once, after the last step (argmax would otherwise turn such logits into token 0 silently)."""

    def __init__(self, model: Transformer, first: torch.Tensor, prompt_len: int, gen_len: int,
                 temperature: float, top_p: float, cuda_graph: bool) -> None:
        B, dev = first.shape[0], first.device
        self.model, self.temperature, self.top_p = model, temperature, top_p
        self.sampler = model_sampler(model)
        self.tokens = first.clone()                                    # [B] int64
        self.pos = torch.full((B,), prompt_len, dtype=torch.int64, device=dev)  # [B] int64
        self.out = torch.zeros(B, gen_len, dtype=torch.int64, device=dev)
        self.out[:, 0] = first
        self.col = torch.ones(1, dtype=torch.int64, device=dev)       # [1] next column of out
        self.first_nonfinite = torch.full((1,), gen_len, dtype=torch.int64, device=dev)
        self.graph = None
        if cuda_graph and dev.type == "cuda":
            self._capture()

    def _step(self) -> None:
        logits = self.model.decode_step(self.tokens, self.pos)
        bad_col = torch.where(torch.isfinite(logits).all(), self.first_nonfinite, self.col)
        torch.minimum(self.first_nonfinite, bad_col, out=self.first_nonfinite)
        nxt = self.sampler(logits, self.temperature, self.top_p)
        self.out.index_copy_(1, self.col, nxt[:, None])
        self.tokens.copy_(nxt)
        self.pos.add_(1)
        self.col.add_(1)

    def _capture(self) -> None:
        # Warm-up runs (allocator, NCCL communicators, Triton compilation) on a side stream, as
        # graph capture requires; each is undone so that the buffers start where they were. The
        # K/V it wrote at the first decode position is overwritten by the first real step.
        bufs = (self.tokens, self.pos, self.col, self.first_nonfinite)
        state = [t.clone() for t in bufs]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._step()
                for t, saved in zip(bufs, state):
                    t.copy_(saved)
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()


@dataclass
class Generation:
    tokens: torch.Tensor  # [B, gen_len] int64 on the CPU; column 0 comes from the prefill
    step_s: list[float]  # time of each of the gen_len - 1 decode steps
    prefill_s: float | None = None  # wall time of the prefill (first token included), warm;
    # None without a prefill (synthetic cache)
    warmup_s: float | None = None  # the first prefill call before it: compiling the kernels
    warmup_len: int = 0  # prompt positions that the warm-up ran (`warmup_spans`)
    fill_s: float | None = None  # synthetic cache: time to fill it (no prefill)


def warmup_spans(prompt_len: int, chunk: int | None) -> list[tuple[int, int]]:
    """[start, end) of the warm-up prefill calls, which launch the kernels the real prefill does:
    the whole prompt if it is one chunk, else its first chunk and its last chunk at their own
    positions (the last attends over the whole cache, so the kernel variants chosen by the key
    length compile too; the positions it skips hold whatever the cache held, and the real
    prefill overwrites everything the warm-up wrote). With chunk a multiple of 2 sp both calls
    are valid sequence-parallel prefills, the tail of decode steps included."""
    if not chunk or prompt_len <= chunk:
        return [(0, prompt_len)]
    return [(0, chunk), (chunk * ((prompt_len - 1) // chunk), prompt_len)]


def generate(model: Transformer, prompt: torch.Tensor, gen_len: int, *,
             prefill_chunk: int | None = None, warm_up: bool = False, temperature: float = 0.0,
             top_p: float = 1.0, cuda_graph: bool = True, progress: bool = False) -> Generation:
    """Prefill `prompt` [B, P] int64 (on the model's device) in chunks of `prefill_chunk`
    positions (None: all at once), then decode gen_len - 1 steps.

    The model's caches must hold P + gen_len - 1 positions. `warm_up` first runs the prefill
    calls of `warmup_spans` (timed apart: on a GPU they compile the kernels), whose cache writes
    the real prefill overwrites, so that `prefill_s` is the warm time. `progress` shows tqdm
    bars on stderr when it is a terminal: the prefill's (chunks done, tokens/s, time left) and
    the decode's. Logits holding NaN or inf raise RuntimeError.
    """
    B, P = prompt.shape
    sync = _synchronizer(prompt.device)
    positions = torch.arange(P, device=prompt.device)
    warmup_s, w = None, 0
    with torch.no_grad():
        if warm_up:
            sync()
            t0 = time.perf_counter()
            for start, end in warmup_spans(P, prefill_chunk):
                model.prefill(prompt[:, start:end], positions[start:end], chunk=prefill_chunk)
                w += end - start
            sync()
            warmup_s = time.perf_counter() - t0
        sync()
        t0 = time.perf_counter()
        logits = _prefill(model, prompt, positions, prefill_chunk, sync, progress)
        first = model_sampler(model)(logits, temperature, top_p)
        sync()
        prefill_s = time.perf_counter() - t0
        if not bool(torch.isfinite(logits).all()):
            raise _nonfinite("the prefill")
        gen = _decode(model, first, P, gen_len, temperature, top_p, cuda_graph, progress)
    gen.prefill_s, gen.warmup_s, gen.warmup_len = prefill_s, warmup_s, w
    return gen


def generate_synthetic(model: Transformer, context_len: int, gen_len: int, *, batch: int,
                       seed: int, cache_seed: int | None = None, temperature: float = 0.0,
                       top_p: float = 1.0, cuda_graph: bool = True,
                       progress: bool = False) -> Generation:
    """Decode without a prefill: the KV caches hold seeded random values of the model's K/V scale
    at positions [0, context_len) (`Transformer.fill_random_cache`, seeded by `cache_seed`,
    default `seed`: give each rank its own), then gen_len - 1 steps decode from a random first
    token (drawn with `seed`, the same on every rank) at position context_len. For measuring
    decode at contexts whose real prefill would take long; the tokens mean nothing."""
    device = model.lm_head.weight.device
    sync = _synchronizer(device)
    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        model.fill_random_cache(context_len, seed if cache_seed is None else cache_seed)
        first = torch.randint(0, model.args.vocab_size, (batch,),
                              generator=torch.Generator().manual_seed(seed)).to(device)
        sync()
        fill_s = time.perf_counter() - t0
        gen = _decode(model, first, context_len, gen_len, temperature, top_p, cuda_graph, progress)
    gen.fill_s = fill_s
    return gen


def _prefill(model: Transformer, prompt: torch.Tensor, positions: torch.Tensor,
             chunk: int | None, sync: Callable[[], None], progress: bool) -> torch.Tensor:
    """model.prefill over the prompt, one call per chunk (the calls model.prefill would make),
    so that a long prefill shows progress: chunks done, tokens/s, time left. Each chunk is
    waited for, which costs nothing a prefill does not already pay (it reads its positions on
    the host in every layer). Returns the last chunk's logits."""
    B, P = prompt.shape
    spans = chunk_spans(P, chunk)
    bar = tqdm(total=B * P, desc="prefill", unit="tok", disable=None if progress else True)
    for i, (start, end) in enumerate(spans):
        logits = model.prefill(prompt[:, start:end], positions[start:end], chunk=chunk)
        sync()
        bar.set_postfix_str(f"chunk {i + 1}/{len(spans)}", refresh=False)
        bar.update(B * (end - start))
    bar.close()
    return logits


def _nonfinite(where: str) -> RuntimeError:
    return RuntimeError(f"the model's logits hold NaN or inf from {where} on: the tokens from "
                        "there are meaningless (argmax would make them token 0). Check the "
                        "checkpoint, the dtype and the context length")


def _synchronizer(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _decode(model: Transformer, first: torch.Tensor, prompt_len: int, gen_len: int,
            temperature: float, top_p: float, cuda_graph: bool, progress: bool) -> Generation:
    """gen_len - 1 decode steps from token `first` [B] at position prompt_len, each timed."""
    step = DecodeStep(model, first, prompt_len, gen_len, temperature, top_p, cuda_graph)
    n = gen_len - 1
    if dist.is_available() and dist.is_initialized():
        # The ranks start the timed steps together: a rank still capturing its graph would
        # otherwise count in the others' first step (their sums wait for its partials).
        dist.barrier()
        _synchronizer(first.device)()
    bar = tqdm(total=n, desc="decode", unit="tok", disable=None if progress else True)
    if first.device.type == "cuda":
        # Queue every step with an event between steps, then follow the events: the GPU
        # never waits for the host, and the bar still moves with the GPU.
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        for i in range(n):
            events[i].record()
            step()
        events[n].record()
        for ev in events[1:]:
            ev.synchronize()
            bar.update(1)
        step_s = [a.elapsed_time(b) / 1e3 for a, b in zip(events[:-1], events[1:])]
    else:
        marks = [time.perf_counter()]
        for _ in range(n):
            step()
            marks.append(time.perf_counter())
            bar.update(1)
        step_s = [b - a for a, b in zip(marks[:-1], marks[1:])]
    bar.close()
    bad = int(step.first_nonfinite)
    if bad < gen_len:
        raise _nonfinite(f"decode step {bad} (of {n})")
    return Generation(step.out.cpu(), step_s)
