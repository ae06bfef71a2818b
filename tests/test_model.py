"""The Llama model against Hugging Face transformers, checkpoint loading, and sampling."""

import json
import re

import pytest
import torch

from longctx.config import ModelArgs
from longctx.generate import generate, sample
from longctx.parallel.build import build_model
from longctx.weights import HFCheckpoint, RandomWeights, Shard
from tests.checkpoint_utils import save_hf_model


def _hf_model(tmp_path, max_shard_size):
    return save_hf_model(tmp_path, rope_theta=5e5, max_shard_size=max_shard_size)


@pytest.mark.parametrize("max_shard_size", ["60KB", "50GB"], ids=["sharded-index", "one-file"])
def test_logits_match_transformers(tmp_path, max_shard_size):
    hf = _hf_model(tmp_path, max_shard_size)
    has_index = (tmp_path / "model.safetensors.index.json").is_file()
    assert has_index == (max_shard_size == "60KB")
    ckpt = HFCheckpoint(tmp_path)
    args = ckpt.args()
    assert (args.n_layers, args.dim, args.n_heads, args.n_kv_heads, args.head_dim,
            args.rope_theta, args.norm_eps) == (2, 64, 4, 2, 16, 5e5, 1e-6)
    B, P, steps = 2, 11, 4
    model = build_model(args, weights=ckpt, device="cpu", dtype=torch.float32, batch=B,
                        max_seq_len=P + steps)
    tokens = torch.randint(0, 128, (B, P + steps), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = [model.prefill(tokens[:, :P], torch.arange(P))]
        for i in range(P, P + steps - 1):
            got.append(model.decode_step(tokens[:, i], torch.full((B,), i)))
        for n, logits in zip(range(P, P + steps), got):
            want = hf(tokens[:, :n]).logits[:, -1].float()
            torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert got[0].std() > 0.5  # the comparison is not between near-constant logits


def test_checkpoint_errors(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        HFCheckpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="neither model.safetensors"):
        HFCheckpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    with pytest.raises(ValueError, match="model_type must be 'llama' or 'qwen2', got 'mistral'"):
        ModelArgs.from_hf_config(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="config.json: no num_hidden_layers field"):
        ModelArgs.from_hf_config(tmp_path / "config.json")


def test_corrupt_checkpoint_files_are_named(tmp_path):
    """A truncated or corrupted safetensors file, shard or JSON file: ValueError naming it."""
    from tests.checkpoint_utils import write_checkpoint

    args = ModelArgs(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, head_dim=16,
                     intermediate_size=96, vocab_size=64)
    write_checkpoint(tmp_path, args)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match=f"{re.escape(str(weights))} is not a readable safetensors file"):
        HFCheckpoint(tmp_path)
    weights.write_bytes(b"\x00not a checkpoint" * 8)  # corrupted
    with pytest.raises(ValueError, match=f"{re.escape(str(weights))} is not a readable safetensors file"):
        HFCheckpoint(tmp_path)
    # Shards: the index names a file that is damaged, read when its tensors are.
    weights.write_bytes(data)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "shard-2.safetensors"}}))
    ckpt = HFCheckpoint(tmp_path)
    (tmp_path / "shard-2.safetensors").write_bytes(data[:100])
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'shard-2.safetensors'} is not a readable")):
        ckpt.read("norm.weight", (64,), None, torch.empty(64))
    index.write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(f"{index} is not readable JSON")):
        HFCheckpoint(tmp_path)
    (tmp_path / "config.json").write_text("")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'config.json'} is not readable JSON")):
        HFCheckpoint(tmp_path)


@pytest.mark.parametrize("name,full", [("layers.0.mlp.up_proj.weight", (200, 70)),
                                       ("layers.0.mlp.down_proj.weight", (70, 200))])
def test_random_weights_any_slice_equals_the_slice_of_the_whole(name, full):
    w = RandomWeights(seed=3)
    whole = torch.empty(full)
    w.read(name, full, None, whole)
    for shard in (Shard(0, 63, 2, full[0]), Shard(0, 35, 35, full[0]), Shard(1, 0, 70, full[1]),
                  Shard(1, 50, 20, full[1])):
        part = torch.empty(whole.narrow(shard.dim, shard.start, shard.length).shape)
        w.read(name, full, shard, part)
        assert torch.equal(part, whole.narrow(shard.dim, shard.start, shard.length)), shard


def test_random_weights_are_deterministic_and_generation_is_repeatable():
    args = ModelArgs(n_layers=1, dim=64, n_heads=4, n_kv_heads=1, head_dim=16,
                     intermediate_size=64, vocab_size=64)
    a, b = (build_model(args, weights=RandomWeights(seed=5), device="cpu", dtype=torch.float32,
                        batch=1, max_seq_len=8) for _ in range(2))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    prompt = torch.randint(0, 64, (1, 1))  # a length-1 prompt
    g = generate(a, prompt, 7)
    assert g.tokens.shape == (1, 7) and len(g.step_s) == 6
    assert torch.equal(generate(b, prompt, 7).tokens, g.tokens)


def test_sample():
    logits = torch.tensor([[0.0, 3.0, 2.5, -1.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits).tolist() == [1, 0]
    # top_p below the top token's probability keeps only that token.
    for _ in range(20):
        assert sample(logits, temperature=1.0, top_p=0.3).tolist() == [1, 0]
    torch.manual_seed(0)
    draws = torch.stack([sample(logits, temperature=1.0) for _ in range(400)])
    freq = (draws[:, 0:1] == torch.arange(4)).float().mean(0)
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), atol=0.07, rtol=0)


def _small_model(device, batch=2, max_seq_len=40, n_heads=4):
    args = ModelArgs(n_layers=2, dim=64, n_heads=n_heads, n_kv_heads=2, head_dim=16,
                     intermediate_size=64, vocab_size=64)
    return build_model(args, weights=RandomWeights(seed=1), device=device, dtype=torch.float32,
                       batch=batch, max_seq_len=max_seq_len)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_model_on_the_kernels_matches_the_reference_path(device):
    """Prefill (in two chunks: the second attends to the cache) and decode through the Triton
    kernels (the interpreter on CPU) give the logits of the CPU reference path."""
    from longctx.backend import force_triton

    ref, fast = _small_model("cpu"), _small_model(device)
    fast.load_state_dict(ref.state_dict())  # CUDA's RNG draws other weights than the CPU's
    tokens = torch.randint(0, 64, (2, 23), generator=torch.Generator().manual_seed(4))
    tol = dict(rtol=1e-5, atol=1e-5) if device == "cpu" else dict(rtol=2e-3, atol=2e-3)  # tf32

    def run(model, dev):
        t = tokens.to(dev)
        out = [model.prefill(t[:, :11], torch.arange(11, device=dev)),
               model.prefill(t[:, 11:20], torch.arange(11, 20, device=dev))]
        for i in range(20, 23):
            out.append(model.decode_step(t[:, i], torch.full((2,), i, device=dev)))
        return [o.cpu() for o in out]

    with torch.no_grad():
        want = run(ref, "cpu")
        with force_triton(device == "cpu"):
            got = run(fast, device)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("n_heads", [4, 6])  # GQA groups 2 and 3
def test_decode_fuses_rope_and_kv_store(n_heads, device, monkeypatch):
    """A decode step through the kernels launches one kernel per layer for RoPE and the KV store
    (rope_store_kv; no rope_ or store_kv) and gives the logits and KV caches, bit for bit, of
    the previous path, the rope_ and store_kv kernels one after the other (ragged positions:
    each sequence at its own slot)."""
    import longctx.kernels.fused as fused
    import longctx.model as model_mod
    from longctx import ops
    from longctx.backend import force_triton

    def separate(q, k, v, cos, sin, pos, k_cache, v_cache, slot):
        ops.rope_(q[:, None], cos, sin, pos[:, None])
        ops.rope_(k[:, None], cos, sin, pos[:, None])
        ops.store_kv(k_cache, v_cache, k, v, slot)

    launches = {}
    for name in ("rope_", "store_kv", "rope_store_kv"):
        def count(*args, _name=name, _fn=getattr(fused, name)):
            launches[_name] = launches.get(_name, 0) + 1
            return _fn(*args)
        monkeypatch.setattr(fused, name, count)

    models = [_small_model(device, n_heads=n_heads) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5)).to(device)
    logits = []
    with torch.no_grad(), force_triton(device == "cpu"):
        for i, model in enumerate(models):
            with monkeypatch.context() as m:
                if i == 1:
                    m.setattr(model_mod, "rope_store_kv", separate)
                model.prefill(tokens[:, :9], torch.arange(9, device=device))
                launches.clear()
                logits.append([model.decode_step(tokens[:, 9 + j],
                                                 torch.tensor([9 + j, 9 + 3 * j], device=device))
                               for j in range(4)])
                if i == 0:
                    assert launches == {"rope_store_kv": 4 * 2}, launches  # 4 steps x 2 layers
    for got, want in zip(*logits):
        assert torch.equal(got, want)
    for a, b in zip(models[0].layers, models[1].layers):
        assert torch.equal(a.self_attn.kv_cache.k_cache, b.self_attn.kv_cache.k_cache)
        assert torch.equal(a.self_attn.kv_cache.v_cache, b.self_attn.kv_cache.v_cache)


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager():
    prompt = torch.randint(0, 64, (2, 17), device="cuda")
    tokens = []
    for graph in (False, True):
        model = _small_model("cuda")
        tokens.append(generate(model, prompt, 12, cuda_graph=graph).tokens)
    assert torch.equal(tokens[0], tokens[1])


@pytest.mark.gpu
def test_batch1_decode_graph_is_bit_identical_to_eager():
    """Batch 1, where every decode-step kernel is one of ours launched with PDL (GEMV, fused
    norms, RoPE with the KV store, split-KV decode, merge): steps replayed from a CUDA graph,
    where the kernels are back to back and overlap under PDL, give the same bits as eager steps
    launched without PDL (strictly one kernel after another). A kernel that started reading or writing
    before its predecessor was done would show here."""
    from longctx.kernels.utils import pdl_off

    args = ModelArgs(n_layers=4, dim=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                     intermediate_size=11008, vocab_size=32000)
    P, n = 4096, 6
    model = build_model(args, weights=RandomWeights(seed=1), device="cuda", dtype=torch.bfloat16,
                        batch=1, max_seq_len=P + n)
    g = torch.Generator(device="cuda").manual_seed(2)
    tokens = torch.randint(0, args.vocab_size, (1, P + n), device="cuda", generator=g)
    with torch.no_grad():
        model.prefill(tokens[:, :P], torch.arange(P, device="cuda"))
        # Teacher-forced steps: each rewrites the same cache slot with the same K/V, so the
        # eager and the replayed runs start from the same state.
        with pdl_off():
            eager = [model.decode_step(tokens[:, P + i], torch.full((1,), P + i, device="cuda"))
                     for i in range(n)]
        tok, pos = tokens[:, P].clone(), torch.full((1,), P, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model.decode_step(tok, pos)  # warm-up outside the capture: rewrites slot P alike
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model.decode_step(tok, pos)
        for i in range(n):
            tok.copy_(tokens[:, P + i])
            pos.fill_(P + i)
            graph.replay()
            assert torch.equal(logits, eager[i]), f"step {i}"
