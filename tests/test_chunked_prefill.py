"""Chunked prefill gives the logits and KV cache of the unchunked prefill; the warm-up prefill; the
synthetic (random) KV cache for decode benchmarks."""

import pytest
import torch

from longctx.backend import force_triton
from longctx.config import ModelArgs
from longctx.generate import generate, generate_synthetic, warmup_spans
from longctx.model import chunk_spans
from longctx.parallel.build import build_model
from longctx.weights import RandomWeights

# The tiny model of configs/model/tiny.yaml (GQA 4/2, head_dim 32).
TINY = ModelArgs(n_layers=2, dim=128, n_heads=4, n_kv_heads=2, head_dim=32, intermediate_size=384,
                 vocab_size=512, name="tiny")
B, P = 2, 71  # an odd prompt length: no chunk size below divides it


def _model(dtype=torch.float64, device="cpu", max_seq_len=P + 8, args=TINY, std=0.2):
    # std 0.2 (not the default 0.02): logits that vary (std ~2), so the comparison has teeth.
    return build_model(args, weights=RandomWeights(seed=1, std=std), device=device, dtype=dtype,
                       batch=B, max_seq_len=max_seq_len)


def _prompt(n=P, vocab=TINY.vocab_size):
    return torch.randint(0, vocab, (B, n), generator=torch.Generator().manual_seed(3))


def _caches(model, n):
    return [t[:, :n].clone() for layer in model.layers
            for t in (layer.self_attn.kv_cache.k_cache, layer.self_attn.kv_cache.v_cache)]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("chunk", [1, 7, 64, P, 0, None, 1000])
def test_chunked_prefill_matches_unchunked(chunk, dtype, tol):
    """Chunk sizes 1, 7 and 64 (a short last chunk each), the whole prompt (P, 0, None) and more
    than it: the same logits after the prompt, the same KV cache, then the same decode logits."""
    model, tokens = _model(dtype), _prompt()
    pos = torch.arange(P)
    with torch.no_grad():
        want = model.prefill(tokens, pos)
        want_cache = _caches(model, P)
        want_steps = [model.decode_step(tokens[:, i], torch.full((B,), P + i)) for i in range(3)]
        for layer in model.layers:  # forget everything: the chunks must rebuild it (finite
            # garbage: the CPU decode weighs the unused slots by 0, and 0 x NaN is NaN)
            layer.self_attn.kv_cache.k_cache.fill_(123.0)
            layer.self_attn.kv_cache.v_cache.fill_(-77.0)
        got = model.prefill(tokens, pos, chunk=chunk)
        got_cache = _caches(model, P)
        got_steps = [model.decode_step(tokens[:, i], torch.full((B,), P + i)) for i in range(3)]
    assert want.std() > 1  # logits that differ between tokens
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for g, w in zip(got_cache, want_cache):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    for g, w in zip(got_steps, want_steps):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def test_chunked_prefill_runs_one_call_per_chunk_and_the_lm_head_once():
    model, tokens = _model(), _prompt()
    calls, heads = [], []
    inner = model.prefill_hidden
    model.prefill_hidden = lambda t, p: (calls.append((int(p[0]), t.shape[1])), inner(t, p))[1]
    model.lm_head.register_forward_hook(lambda m, i, o: heads.append(i[0].shape))
    with torch.no_grad():
        model.prefill(tokens, torch.arange(P), chunk=32)
    assert calls == [(0, 32), (32, 32), (64, 7)]
    assert heads == [torch.Size([B, TINY.dim])]  # only the last chunk's last row


@pytest.mark.gpu
@pytest.mark.interpreter
def test_chunked_prefill_on_the_kernels(device):
    """The same through the Triton kernels (the interpreter on CPU): chunk 5 of 23 positions."""
    args = ModelArgs(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, head_dim=16,
                     intermediate_size=64, vocab_size=64)
    ref, fast = (_model(torch.float32, d, 24, args) for d in ("cpu", device))
    fast.load_state_dict(ref.state_dict())
    tokens = _prompt(23, 64)
    tol = dict(rtol=1e-5, atol=1e-5) if device == "cpu" else dict(rtol=2e-3, atol=2e-3)  # tf32
    with torch.no_grad():
        want = ref.prefill(tokens, torch.arange(23))
        with force_triton(device == "cpu"):
            got = fast.prefill(tokens.to(device), torch.arange(23, device=device), chunk=5)
    torch.testing.assert_close(got.cpu(), want, **tol)


@pytest.mark.parametrize("chunk", [-1, 2.5, True, "8"])
def test_bad_chunk_is_refused(chunk):
    model = _model()
    with pytest.raises(ValueError, match=r"prefill_chunk must be a positive integer .* got"):
        model.prefill(_prompt(), torch.arange(P), chunk=chunk)


def test_prefill_needs_a_prompt():
    model = _model()
    with pytest.raises(ValueError, match=r"tokens must be \[B, S\] with S >= 1"):
        model.prefill(torch.zeros(B, 0, dtype=torch.int64), torch.arange(0))


def test_chunk_spans_and_warmup_spans():
    assert chunk_spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_spans(10, None) == chunk_spans(10, 0) == chunk_spans(10, 20) == [(0, 10)]
    assert chunk_spans(1, 1) == [(0, 1)] and chunk_spans(0, 4) == []
    # One chunk: the whole prompt. Else the first chunk and the last, at their positions.
    assert warmup_spans(100, None) == warmup_spans(100, 100) == [(0, 100)]
    assert warmup_spans(101, 50) == [(0, 50), (100, 101)]
    assert warmup_spans(150, 50) == [(0, 50), (100, 150)]
    for p, c in ((101, 50), (150, 50), (1000, 64), (977, 7), (8, 1)):
        spans = chunk_spans(p, c)
        assert warmup_spans(p, c) == [spans[0], spans[-1]]


def test_warm_up_does_not_change_the_tokens():
    """The warm-up prefill writes the cache positions that the real prefill then overwrites."""
    tokens = _prompt()
    runs = [generate(_model(torch.float32), tokens, 6, prefill_chunk=16, warm_up=w)
            for w in (False, True)]
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert runs[0].warmup_s is None and runs[1].warmup_s > 0 and runs[1].warmup_len == 16 + 7
    assert runs[1].prefill_s > 0 and len(runs[1].step_s) == 5


def test_synthetic_cache_has_the_scale_of_a_real_prefill():
    """fill_random_cache: positions [0, context_len) hold values whose std per layer and KV
    head is that of the k/v a real prefill of random tokens writes (within 15%); the rest of the
    cache stays empty; the same seed gives the same cache."""
    n = 600
    real, synth = (_model(torch.float32, max_seq_len=n + 4, std=0.02) for _ in range(2))
    with torch.no_grad():
        real.prefill(_prompt(n), torch.arange(n))
    synth.fill_random_cache(n, seed=7)
    for lr, ls in zip(real.layers, synth.layers):
        cr, cs = lr.self_attn.kv_cache, ls.self_attn.kv_cache
        for want, got in ((cr.k_cache, cs.k_cache), (cr.v_cache, cs.v_cache)):
            s_want, s_got = want[:, :n].std(dim=(0, 1, 3)), got[:, :n].std(dim=(0, 1, 3))
            torch.testing.assert_close(s_got, s_want, rtol=0.15, atol=0)
            assert got[:, n:].abs().max() == 0
            assert abs(float(got[:, :n].mean())) < 0.05 * float(s_got.mean())
    again = _model(torch.float32, max_seq_len=n + 4, std=0.02)
    again.fill_random_cache(n, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(_caches(again, n), _caches(synth, n)))
    other = _model(torch.float32, max_seq_len=n + 4, std=0.02)
    other.fill_random_cache(n, seed=8)
    assert not torch.equal(_caches(other, n)[0], _caches(synth, n)[0])


def test_kv_std_is_std_times_sqrt_dim_for_random_weights():
    """The comment in Attention.kv_std: N(0, std^2) weights and unit norm weights give std
    sqrt(dim) per head (up to sampling: 2 x 32 x 128 weights per head)."""
    model = _model(torch.float32, std=0.02)
    k_std, v_std = model.layers[0].self_attn.kv_std(model.layers[0].input_layernorm.weight)
    want = torch.full((TINY.n_kv_heads,), 0.02 * TINY.dim ** 0.5)
    torch.testing.assert_close(k_std, want, rtol=0.05, atol=0)
    torch.testing.assert_close(v_std, want, rtol=0.05, atol=0)


def test_generate_shows_the_chunked_prefill_progress(monkeypatch):
    """generate's prefill: one model.prefill call per chunk, the unchunked logits, and a bar that
    counts tokens (so tqdm shows tokens/s and the time left) with the chunks done beside it."""
    import longctx.generate as G

    bars = []

    class Bar:
        def __init__(self, total, desc, unit, disable):
            self.total, self.desc, self.n, self.notes = total, desc, 0, []
            bars.append(self)

        def set_postfix_str(self, s, refresh=True):
            self.notes.append(s)

        def update(self, n):
            self.n += n

        def close(self):
            pass

    monkeypatch.setattr(G, "tqdm", Bar)
    model, tokens = _model(), _prompt()
    calls = []
    inner = model.prefill
    model.prefill = lambda t, p, chunk: (calls.append((int(p[0]), t.shape[1])), inner(t, p, chunk))[1]
    g = generate(model, tokens, 3, prefill_chunk=32, cuda_graph=False, progress=True)
    assert calls == [(0, 32), (32, 32), (64, 7)]
    prefill_bar = bars[0]
    assert (prefill_bar.desc, prefill_bar.total, prefill_bar.n) == ("prefill", B * P, B * P)
    assert prefill_bar.notes == ["chunk 1/3", "chunk 2/3", "chunk 3/3"]
    assert bars[1].desc == "decode" and bars[1].n == 2
    ref = _model()
    with torch.no_grad():
        first = ref.prefill(tokens, torch.arange(P)).argmax(-1)
    assert torch.equal(g.tokens[:, 0], first)


def test_non_finite_logits_are_reported_not_sampled():
    """NaN / inf logits raise, naming where they began, instead of argmax turning them into
    token 0 for the rest of the run: from the prefill, and from a decode step."""
    model, tokens = _model(torch.float32), _prompt()
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")
    with pytest.raises(RuntimeError, match=r"logits hold NaN or inf from the prefill on"):
        generate(model, tokens, 4, cuda_graph=False)
    model = _model(torch.float32)
    inner, steps = model.decode_step, []

    def decode_step(tok, pos):
        steps.append(1)
        logits = inner(tok, pos)
        return logits.fill_(float("inf")) if len(steps) >= 2 else logits

    model.decode_step = decode_step
    with pytest.raises(RuntimeError, match=r"logits hold NaN or inf from decode step 2 \(of 4\) on"):
        generate(model, tokens, 5, cuda_graph=False)


def test_generate_synthetic_decodes_from_the_random_cache():
    """Decode after the synthetic cache: from position context_len on, as after a prefill of that
    length (the same steps on a model whose cache is a copy give the same tokens); the first
    token is seeded."""
    n = 40
    a, b = (_model(torch.float32, max_seq_len=n + 6) for _ in range(2))
    g = generate_synthetic(a, n, 6, batch=B, seed=5)
    assert g.prefill_s is None and g.fill_s > 0 and g.tokens.shape == (B, 6)
    b.fill_random_cache(n, seed=5)
    tok = g.tokens[:, 0]
    assert torch.equal(tok, torch.randint(0, TINY.vocab_size, (B,),
                                          generator=torch.Generator().manual_seed(5)))
    with torch.no_grad():
        for i in range(5):
            tok = b.decode_step(tok, torch.full((B,), n + i)).argmax(-1)
            assert torch.equal(tok, g.tokens[:, i + 1]), i
    with pytest.raises(ValueError, match=r"context_len must be in \[1, 46\)"):
        b.fill_random_cache(46, seed=0)


def test_decode_timing_starts_with_the_ranks_together(monkeypatch, tmp_path):
    """Under a process group the timed decode steps start after a barrier (a rank still capturing
    its graph would otherwise count in the others' first step); without one, none is called."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append(1))
    model = _model(torch.float32, max_seq_len=20)
    generate_synthetic(model, 10, 3, batch=B, seed=0)
    assert calls == []
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        generate_synthetic(model, 10, 3, batch=B, seed=0)
    finally:
        dist.destroy_process_group()
    assert calls == [1]


@pytest.mark.gpu
def test_chunked_prefill_bf16_on_cuda_within_twice_the_unchunked_error():
    """On one GPU in bf16: the chunked prefill's logits are as close to the fp32 unchunked
    prefill's as the bf16 unchunked prefill's are (at most 2x its error), for chunks that are
    and are not multiples of the kernels' tiles."""
    args = ModelArgs(n_layers=4, dim=1024, n_heads=8, n_kv_heads=2, head_dim=128,
                     intermediate_size=2816, vocab_size=4096)
    n = 4096 + 77
    ref = build_model(args, weights=RandomWeights(seed=1, std=0.05), device="cuda",
                      dtype=torch.float32, batch=2, max_seq_len=n)
    low = build_model(args, weights=RandomWeights(seed=1, std=0.05), device="cuda", dtype=torch.bfloat16,
                      batch=2, max_seq_len=n)
    low.load_state_dict(ref.state_dict())  # the same weights, rounded to bf16
    tokens = torch.randint(0, args.vocab_size, (2, n), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(2))
    pos = torch.arange(n, device="cuda")
    with torch.no_grad():
        want = ref.prefill(tokens, pos)
        base = (low.prefill(tokens, pos) - want).abs().max().item()
        for chunk in (1024, 1000, 2048, 3000):
            err = (low.prefill(tokens, pos, chunk=chunk) - want).abs().max().item()
            assert err <= 2 * base, (chunk, err, base)
    assert want.std() > 0.5 and base > 0


@pytest.mark.gpu
def test_synthetic_cache_on_cuda_in_bf16():
    """On a GPU in bf16: the fill runs on the device (a CUDA generator), gives each KV head the
    std of Attention.kv_std (within 2%: ~10^6 draws per head) and leaves later positions empty;
    decoding from it gives finite logits."""
    args = ModelArgs(n_layers=2, dim=1024, n_heads=8, n_kv_heads=2, head_dim=128,
                     intermediate_size=2816, vocab_size=4096)
    n = 8191
    model = build_model(args, weights=RandomWeights(seed=1), device="cuda", dtype=torch.bfloat16,
                        batch=2, max_seq_len=n + 4)
    g = generate_synthetic(model, n, 4, batch=2, seed=3)
    assert g.fill_s > 0 and g.tokens.shape == (2, 4)
    for layer in model.layers:
        attn = layer.self_attn
        want = attn.kv_std(layer.input_layernorm.weight)
        for cache, std in zip((attn.kv_cache.k_cache, attn.kv_cache.v_cache), want):
            got = cache[:, :n].float().std(dim=(0, 1, 3))
            torch.testing.assert_close(got, std, rtol=0.02, atol=0)
            assert cache[:, n + 3:].abs().max() == 0  # decode wrote n .. n+2 only
    with torch.no_grad():
        logits = model.decode_step(g.tokens[:, -1].cuda(), torch.full((2,), n + 3, device="cuda"))
    assert torch.isfinite(logits).all()
