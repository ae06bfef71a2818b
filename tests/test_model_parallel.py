"""Tensor- and sequence-parallel decoding give the tokens and logits of one process (gloo, fp32)."""

import pytest
import torch
import torch.distributed as dist

from longctx.backend import force_triton
from longctx.config import ModelArgs
from longctx.generate import generate
from longctx.parallel.build import build_model
from longctx.parallel.mesh import ParallelDims
from longctx.parallel.sampling import full_logits
from longctx.weights import HFCheckpoint, RandomWeights
from tests.checkpoint_utils import write_checkpoint
from tests.dist_utils import run_distributed

PROMPT, GEN, BATCH = 13, 6, 2  # 13: not a multiple of 2 sp, so some prompt tokens go round-robin


def tiny(n_kv_heads: int = 2) -> ModelArgs:
    return ModelArgs(n_layers=2, dim=64, n_heads=4, n_kv_heads=n_kv_heads, head_dim=16,
                     intermediate_size=96, vocab_size=128, name="test")


def _build(args, mesh=None, weights=None, prompt_len=PROMPT):
    # Room for the prompt and GEN tokens after it.
    return build_model(args, weights=weights or RandomWeights(seed=3), device="cpu",
                       dtype=torch.float32, batch=BATCH, max_seq_len=prompt_len + GEN, mesh=mesh)


def _compare(args, mesh, weights=None, prompt_len=PROMPT, chunk=None) -> None:
    """The parallel model (weights from `weights`, default the seeded random ones; prefill in
    chunks of `chunk`) against one process with the seeded random weights (unchunked prefill):
    logits after the prefill and a few decode steps, then greedy tokens."""
    prompt = torch.randint(0, args.vocab_size, (BATCH, prompt_len),
                           generator=torch.Generator().manual_seed(1))
    ref, par = _build(args, None, None, prompt_len), _build(args, mesh, weights, prompt_len)
    with torch.no_grad():
        pos = torch.arange(prompt_len)
        torch.testing.assert_close(full_logits(par, par.prefill(prompt, pos, chunk=chunk)),
                                   ref.prefill(prompt, pos), rtol=1e-5, atol=1e-5)
        for i in range(3):  # decode logits at a few positions past the prompt
            tok, p = prompt[:, i], torch.full((BATCH,), prompt_len + i)
            torch.testing.assert_close(full_logits(par, par.decode_step(tok, p)),
                                       ref.decode_step(tok, p), rtol=1e-5, atol=1e-5)
    # Fresh caches: greedy generation end to end.
    ref.setup_caches(BATCH, prompt_len + GEN)
    par.setup_caches(BATCH, prompt_len + GEN)
    want = generate(ref, prompt, GEN).tokens
    got = generate(par, prompt, GEN, prefill_chunk=chunk, warm_up=chunk is not None).tokens
    assert torch.equal(got, want), (got, want)


def _continued_prefill(args, mesh) -> None:
    """A sequence-parallel prefill may continue one that filled positions [0, start), start a
    multiple of 2 sp (as the warm-up's last chunk does): the same logits as one prefill."""
    n = 21
    prompt = torch.randint(0, args.vocab_size, (BATCH, n), generator=torch.Generator().manual_seed(4))
    ref, par = _build(args, prompt_len=n), _build(args, mesh, prompt_len=n)
    pos = torch.arange(n)
    with torch.no_grad():
        par.prefill(prompt[:, :12], pos[:12], chunk=4)
        got = par.prefill(prompt[:, 12:], pos[12:], chunk=4)  # 8 positions in 2 chunks + 1
        torch.testing.assert_close(got, ref.prefill(prompt, pos), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match=r"start a multiple of 2 x sp \(4\) .* from 6"):
            par.prefill(prompt[:, 6:], pos[6:])


def _compare_synthetic(args, mesh, context_len) -> None:
    """Decode after `fill_random_cache` with sequence parallelism: each rank fills its share of
    positions [0, context_len), placed round-robin (position q on sp rank q % sp, slot q // sp),
    and decoding continues the rule. One process whose cache holds the ranks' values at those
    positions gives the same logits."""
    par, ref = _build(args, mesh, prompt_len=context_len), _build(args, prompt_len=context_len)
    sp_group = mesh.get_group("sp")
    sp, sp_rank = dist.get_world_size(sp_group), dist.get_rank(sp_group)
    par.fill_random_cache(context_len, seed=10 + dist.get_rank())
    for lp, lr in zip(par.layers, ref.layers):
        cp, cr = lp.self_attn.kv_cache, lr.self_attn.kv_cache
        assert cp.prefix_slots(context_len) == len(range(sp_rank, context_len, sp))
        for mine, full in ((cp.k_cache, cr.k_cache), (cp.v_cache, cr.v_cache)):
            # Every rank of the sp group has a slice of the KV heads of its tp rank: gather the
            # sp group's shards and lay them out by position.
            shards = [torch.empty_like(mine) for _ in range(sp)]
            dist.all_gather(shards, mine, group=sp_group)
            tp_group = mesh.get_group("tp")
            tp, hkv = dist.get_world_size(tp_group), mine.shape[2]
            heads = [torch.empty(sp, *mine.shape) for _ in range(tp)]
            dist.all_gather(heads, torch.stack(shards), group=tp_group)
            heads = torch.cat(heads, dim=3) if hkv * tp == args.n_kv_heads else heads[0]
            for q in range(context_len):
                full[:, q] = heads[q % sp][:, q // sp]
    prompt = torch.randint(0, args.vocab_size, (BATCH, GEN), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for i in range(GEN):
            p = torch.full((BATCH,), context_len + i)
            torch.testing.assert_close(full_logits(par, par.decode_step(prompt[:, i], p)),
                                       ref.decode_step(prompt[:, i], p), rtol=1e-5, atol=1e-5)


def _world_of_2(rank, world, mqa_checkpoint):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    # tp=2: KV heads split; then MQA, its one KV head replicated, each rank reading its slices
    # of a checkpoint that holds the same weights; then sp=2.
    tp_mesh = ParallelDims(2, 1, world).build_mesh("cpu")
    _compare(tiny(2), tp_mesh)
    _compare(tiny(1), tp_mesh, HFCheckpoint(mqa_checkpoint))
    _compare(tiny(2), tp_mesh, chunk=5)  # chunks of 5, 5, 3
    sp_mesh = ParallelDims(1, 2, world).build_mesh("cpu")
    for prompt_len in (PROMPT, 12, 3):  # ring + round-robin tail, ring only, tail only
        _compare(tiny(2), sp_mesh, prompt_len=prompt_len)
    # Chunks (multiples of 2 sp): 4 + 4 + 4 and a tail of 1; 8 + 4 and the tail; 8 + 8 + 4.
    for prompt_len, chunk in ((PROMPT, 4), (PROMPT, 8), (20, 8)):
        _compare(tiny(2), sp_mesh, prompt_len=prompt_len, chunk=chunk)
    with pytest.raises(ValueError, match=r"prefill_chunk \(6\) must be a multiple of 2 x "
                                         r"parallel.sp \(4\)"):
        _compare(tiny(2), sp_mesh, chunk=6)
    _continued_prefill(tiny(2), sp_mesh)
    for context_len in (11, 1):
        _compare_synthetic(tiny(2), sp_mesh, context_len)


def _sp2_on_the_kernels(rank, world):
    torch.set_num_threads(1)
    with force_triton():  # the Triton kernels (interpreter): attention, decode, merge
        _compare(tiny(2), ParallelDims(1, 2, world).build_mesh("cpu"), chunk=4)


def _world_of_4(rank, world):
    torch.set_num_threads(1)
    mesh = ParallelDims(2, 2, world).build_mesh("cpu")
    _compare(tiny(2), mesh)
    _compare(tiny(2), mesh, chunk=4)  # 4 + 4 + 4 on each sp group, then a tail of 1
    _compare_synthetic(tiny(2), mesh, 10)
    _compare(tiny(2), ParallelDims(4, 1, world).build_mesh("cpu"))  # 2 KV heads, each on 2 ranks


def test_tp2_and_sp2_match_one_process(tmp_path):
    write_checkpoint(tmp_path, tiny(1), seed=3)
    run_distributed(_world_of_2, 2, str(tmp_path))


@pytest.mark.interpreter
def test_sp2_on_the_kernels_matches_one_process():
    run_distributed(_sp2_on_the_kernels, 2)


def test_tp2_x_sp2_and_tp4_match_one_process():
    run_distributed(_world_of_4, 4)
