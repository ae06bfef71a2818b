"""Tensor- and sequence-parallel decoding give the tokens and logits of one process (gloo, fp32)."""

import torch

from longctx.backend import force_triton, interpreter_active
from longctx.config import ModelArgs
from longctx.generate import generate
from longctx.parallel.build import build_model
from longctx.parallel.mesh import ParallelDims
from longctx.weights import HFCheckpoint, RandomWeights
from tests.checkpoint_utils import write_checkpoint
from tests.dist_utils import run_distributed

PROMPT, GEN, BATCH = 13, 6, 2  # 13: not a multiple of 2 sp, so some prompt tokens go round-robin


def tiny(n_kv_heads: int = 2) -> ModelArgs:
    return ModelArgs(n_layers=2, dim=64, n_heads=4, n_kv_heads=n_kv_heads, head_dim=16,
                     intermediate_size=96, vocab_size=128, name="test")


def _build(args, mesh=None, weights=None, prompt_len=PROMPT):
    return build_model(args, weights=weights or RandomWeights(seed=3), device="cpu",
                       dtype=torch.float32, batch=BATCH, max_seq_len=prompt_len + GEN, mesh=mesh)


def _compare(args, mesh, weights=None, prompt_len=PROMPT) -> None:
    """The parallel model (weights from `weights`, default the seeded random ones) against one
    process with the seeded random weights: logits after the prefill and a few decode steps,
    then greedy tokens."""
    prompt = torch.randint(0, args.vocab_size, (BATCH, prompt_len),
                           generator=torch.Generator().manual_seed(1))
    ref, par = _build(args, None, None, prompt_len), _build(args, mesh, weights, prompt_len)
    with torch.no_grad():
        pos = torch.arange(prompt_len)
        torch.testing.assert_close(par.prefill(prompt, pos), ref.prefill(prompt, pos),
                                   rtol=1e-5, atol=1e-5)
        for i in range(3):  # decode logits at a few positions past the prompt
            tok, p = prompt[:, i], torch.full((BATCH,), prompt_len + i)
            torch.testing.assert_close(par.decode_step(tok, p), ref.decode_step(tok, p),
                                       rtol=1e-5, atol=1e-5)
    # Fresh caches: greedy generation end to end.
    ref.setup_caches(BATCH, prompt_len + GEN)
    par.setup_caches(BATCH, prompt_len + GEN)
    want = generate(ref, prompt, GEN).tokens
    got = generate(par, prompt, GEN).tokens
    assert torch.equal(got, want), (got, want)


def _world_of_2(rank, world, mqa_checkpoint):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    # tp=2: KV heads split; then MQA, its one KV head replicated, each rank reading its slices
    # of a checkpoint that holds the same weights; then sp=2.
    tp_mesh = ParallelDims(2, 1, world).build_mesh("cpu")
    _compare(tiny(2), tp_mesh)
    _compare(tiny(1), tp_mesh, HFCheckpoint(mqa_checkpoint))
    sp_mesh = ParallelDims(1, 2, world).build_mesh("cpu")
    for prompt_len in (PROMPT, 12, 3):  # ring + round-robin tail, ring only, tail only
        _compare(tiny(2), sp_mesh, prompt_len=prompt_len)
    if interpreter_active():  # the same through the Triton kernels: attention, decode, merge
        with force_triton():
            _compare(tiny(2), sp_mesh)


def _world_of_4(rank, world):
    torch.set_num_threads(1)
    _compare(tiny(2), ParallelDims(2, 2, world).build_mesh("cpu"))
    _compare(tiny(2), ParallelDims(4, 1, world).build_mesh("cpu"))  # 2 KV heads, each on 2 ranks


def test_tp2_and_sp2_match_one_process(tmp_path):
    write_checkpoint(tmp_path, tiny(1), seed=3)
    run_distributed(_world_of_2, 2, str(tmp_path))


def test_tp2_x_sp2_and_tp4_match_one_process():
    run_distributed(_world_of_4, 4)
