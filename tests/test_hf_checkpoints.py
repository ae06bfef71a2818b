"""Checkpoints saved by transformers decode to transformers' greedy tokens, with its logits: Llama
with each RoPE scaling (in the config spellings of transformers 4.x and 5.x) and Qwen2 (q/k/v
biases, tied embeddings, YaRN), on one process, chunked, through the Triton kernels, and at tp=2
and sp=2 (gloo). fp32 on the CPU; the bf16 GPU check is at the end."""

import pytest
import torch

from longctx.backend import force_triton, interpreter_active
from longctx.generate import generate
from longctx.parallel.build import build_model
from longctx.parallel.mesh import ParallelDims
from longctx.parallel.sampling import full_logits
from longctx.weights import HFCheckpoint
from tests.checkpoint_utils import (YARN_AS_IN_TRANSFORMERS_5, hf_greedy, load_hf_model,
                                    save_hf_model)
from tests.dist_utils import run_distributed

# name -> save_hf_model arguments. "dynamic" sets max_position_embeddings 8 so that prompts and
# decoding cross it (PROMPTS); the others scale at any length.
CASES = {
    "linear": dict(rope={"rope_type": "linear", "factor": 2.5}, spelling="4.x"),
    "dynamic": dict(rope={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8),
    "dynamic-4.x": dict(rope={"rope_type": "dynamic", "factor": 3.0}, max_position_embeddings=8,
                        spelling="4.x"),
    "llama3": dict(rope={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "yarn": dict(rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                 spelling="4.x"),
    "qwen2": dict(model_type="qwen2"),
    # Qwen2.5-0.5B-like: tied embeddings, one KV head (replicated under tp=2), YaRN in Qwen2.5's
    # spelling (the original length is max_position_embeddings).
    "qwen2-yarn-tied-mqa": dict(model_type="qwen2", rope={"rope_type": "yarn", "factor": 4.0},
                                max_position_embeddings=16, tie_word_embeddings=True,
                                num_key_value_heads=1),
}
MARKS = {"yarn": YARN_AS_IN_TRANSFORMERS_5}
B, STEPS = 2, 6
PROMPTS = {"dynamic": (5, 11), "dynamic-4.x": (11,)}  # within and beyond max_position_embeddings
TOL = dict(rtol=1e-4, atol=1e-4)


def _prompt(n, vocab=128, seed=1):
    return torch.randint(0, vocab, (B, n), generator=torch.Generator().manual_seed(seed))


def _reference(tmp_path, name):
    """Save case `name` with transformers; -> (checkpoint dir, [(prompt, tokens, logits)])."""
    path = tmp_path / name
    save_hf_model(path, **CASES[name])
    refs = []
    for n in PROMPTS.get(name, (9,)):
        prompt = _prompt(n)
        refs.append((prompt, *hf_greedy(load_hf_model(path), prompt, STEPS)))
    assert refs[0][2].std() > 0.5  # logits that vary: the comparison has teeth
    return path, refs


def _check(model, prompt, tokens, logits, chunk=None):
    """Greedy tokens equal transformers'; then, teacher-forced, the logits of each step."""
    P = prompt.shape[1]
    model.setup_caches(B, P + STEPS)
    got = generate(model, prompt, STEPS, prefill_chunk=chunk, warm_up=chunk is not None).tokens
    assert torch.equal(got, tokens), (got, tokens)
    model.setup_caches(B, P + STEPS)
    with torch.no_grad():
        torch.testing.assert_close(full_logits(model, model.prefill(prompt, torch.arange(P),
                                                                    chunk=chunk)), logits[0], **TOL)
        for i in range(STEPS - 1):
            step = model.decode_step(tokens[:, i], torch.full((B,), P + i))
            torch.testing.assert_close(full_logits(model, step), logits[i + 1], **TOL)


def _build(path, mesh=None, max_seq_len=64):
    ckpt = HFCheckpoint(path)
    return build_model(ckpt.args(), weights=ckpt, device="cpu", dtype=torch.float32, batch=B,
                       max_seq_len=max_seq_len, mesh=mesh)


@pytest.mark.parametrize("name", [pytest.param(n, marks=MARKS.get(n, ())) for n in CASES])
def test_one_process_matches_transformers(tmp_path, name):
    path, refs = _reference(tmp_path, name)
    args = HFCheckpoint(path).args()
    rope = CASES[name].get("rope")
    assert (args.rope_scaling is None) == (rope is None)
    assert args.qkv_bias == (CASES[name].get("model_type") == "qwen2")
    model = _build(path)
    for prompt, tokens, logits in refs:
        _check(model, prompt, tokens, logits)
        # Chunks of 4 (and the warm-up's calls): the tables of the whole prompt (dynamic NTK).
        _check(model, prompt, tokens, logits, chunk=4)


@pytest.mark.skipif(not interpreter_active(), reason="the CPU run of the Triton kernels")
def test_triton_kernels_match_transformers(tmp_path):
    """The kernels (prefill attention, RoPE, RoPE + KV store, decode; the interpreter) read the
    scaled tables (YaRN's attention factor in cos/sin) and the biased projections."""
    path, [(prompt, tokens, logits)] = _reference(tmp_path, "qwen2-yarn-tied-mqa")
    with force_triton():
        _check(_build(path), prompt, tokens, logits)


def _world_of_2(rank, world, cases):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    for name, (path, refs) in cases.items():
        layouts = [(2, 1, None), (1, 2, None)]
        if name.startswith("dynamic"):  # chunks of 4: the tables of the whole prompt
            layouts.append((1, 2, 4))
        for tp, sp, chunk in layouts:
            model = _build(path, ParallelDims(tp, sp, world).build_mesh("cpu"))
            for prompt, tokens, logits in refs:
                _check(model, prompt, tokens, logits, chunk=chunk)


@YARN_AS_IN_TRANSFORMERS_5
def test_tp2_and_sp2_match_transformers(tmp_path):
    cases = {name: _reference(tmp_path, name) for name in CASES}
    cases = {name: (str(path), refs) for name, (path, refs) in cases.items()}
    run_distributed(_world_of_2, 2, cases)


@pytest.mark.gpu
def test_bf16_on_gpu_within_twice_the_error_of_transformers(tmp_path):
    """A Qwen2 with YaRN (head_dim 128, GQA 8/2) in bf16 on the GPU at batch 1, where each
    projection is the Triton GEMV (q/k/v bias in its epilogue) and RoPE runs from the scaled
    tables in the fused kernels: against transformers in fp32 (teacher-forced on its greedy
    tokens), the logits' error is at most twice that of transformers itself in bf16."""
    # Qwen2.5's spelling (the original length is max_position_embeddings): the one on which
    # the YaRN code of transformers 4.4x, 4.5x and 5 agree.
    save_hf_model(tmp_path, model_type="qwen2", rope={"rope_type": "yarn", "factor": 4.0},
                  hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=2816, vocab_size=4096, max_position_embeddings=256,
                  bias_std=0.2)
    P, steps = 600, 8  # past the original length: the interpolated frequencies matter
    prompt = _prompt(P, vocab=4096)[:1].cuda()
    hf = load_hf_model(tmp_path).cuda()
    tokens, _ = hf_greedy(hf, prompt, steps)
    seq = torch.cat([prompt, tokens[:, :-1]], dim=1)
    with torch.no_grad():
        want = hf(seq).logits[0, P - 1:].double()  # [steps, V]: fp32, the reference
        plain = hf.to(torch.bfloat16)(seq).logits[0, P - 1:].double()
        ckpt = HFCheckpoint(tmp_path)
        model = build_model(ckpt.args(), weights=ckpt, device="cuda", dtype=torch.bfloat16,
                            batch=1, max_seq_len=P + steps)
        got = [model.prefill(prompt, torch.arange(P, device="cuda"))]
        for i in range(steps - 1):
            got.append(model.decode_step(tokens[:, i], torch.full((1,), P + i, device="cuda")))
    got = torch.cat(got).double()
    err, err_plain = (got - want).abs().amax(-1), (plain - want).abs().amax(-1)
    assert want.std() > 0.5
    assert (err <= 2 * err_plain + 1e-3).all(), (err, err_plain)
