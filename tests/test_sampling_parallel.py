"""Vocabulary-parallel sampling (longctx.parallel.sampling) gives the tokens of `sample` over the
full vocabulary for the same seed: on random logits with deliberate ties, and end to end through
generate() (prefill's token and the decode steps) against one process (gloo, float32)."""

import pytest
import torch
import torch.distributed as dist

from longctx.generate import generate, sample
from longctx.parallel.mesh import ParallelDims
from longctx.parallel.sampling import VocabParallelSampler, full_logits, gather_logits
from tests.dist_utils import run_distributed
from tests.test_model_parallel import BATCH, GEN, PROMPT, _build, tiny

# (temperature, top_p): greedy, temperature alone (no gather), and with a nucleus (gathers).
MODES = [(0.0, 1.0), (0.8, 1.0), (1.3, 1.0), (0.8, 0.6), (1.0, 0.95)]


def _tied_logits(V: int, tp: int) -> torch.Tensor:
    """[R, V] float32 rows built to trip a wrong tie rule or a wrong shard offset, identical on
    every rank: equal maxima in different shards and within one shard, constant rows, -inf
    masks, +inf and NaN entries, coarsely rounded random rows (many ties), plain random rows."""
    g = torch.Generator().manual_seed(7)
    s = V // tp
    rows = []
    r = torch.randn(V, generator=g)
    r[[3, s + 1, V - 1]] = 9.0  # the same max in the first, second and last shard: token 3
    rows.append(r)
    r = torch.randn(V, generator=g)
    r[[V - 2, s + 5, s + 2]] = 9.0  # ties only past the first shard: token s + 2
    rows.append(r)
    rows.append(torch.zeros(V))  # every token tied: token 0
    rows.append(torch.full((V,), -3.5))
    r = torch.randn(V, generator=g)
    r[: V - 3] = float("-inf")  # only the last shard's last tokens are allowed
    rows.append(r)
    r = torch.randn(V, generator=g)
    r[[s + 4, 2]] = float("inf")
    rows.append(r)
    r = torch.randn(V, generator=g)
    r[[V - 1, s]] = float("nan")  # torch.argmax picks the first NaN
    rows.append(r)
    rows.append(torch.full((V,), float("-inf")))
    rows += list(torch.randn(8, V, generator=g).mul(2).round())  # many ties at the top
    rows += list(torch.randn(40, V, generator=g).mul(3))
    return torch.stack(rows)


def _same_on_all_ranks(t: torch.Tensor, group=None) -> None:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, t, group=group)
    assert all(torch.equal(e, t) for e in everyone), everyone


def _sampler_matches_sample(group, V: int) -> None:
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    sampler = VocabParallelSampler(group, V)
    full = _tied_logits(V, tp)
    shard = full[:, r * V // tp:(r + 1) * V // tp].contiguous()
    torch.testing.assert_close(sampler.gather(shard), full, rtol=0, atol=0, equal_nan=True)

    greedy = sampler(shard)
    assert torch.equal(greedy, sample(full)), (greedy, sample(full))
    s = V // tp
    assert greedy[:4].tolist() == [3, s + 2, 0, 0]  # the tie rule, spelled out
    assert greedy[4] >= V - 3 and greedy[5] == 2 and greedy[6] == s and greedy[7] == 0
    _same_on_all_ranks(greedy, group)

    finite = full[:6].nan_to_num(posinf=50.0).clone()  # sample() gives NaN probs for +inf/NaN
    finite = torch.cat([finite, full[8:]])
    shard = finite[:, r * s:(r + 1) * s].contiguous()
    for seed, (temperature, top_p) in enumerate(MODES):
        torch.manual_seed(100 + seed)
        want = sample(finite, temperature, top_p)
        after_want = torch.rand(4)  # the generator must advance as sample() advances it
        torch.manual_seed(100 + seed)
        got = sampler(shard, temperature, top_p)
        assert torch.equal(got, want), (temperature, top_p, got, want)
        assert torch.equal(torch.rand(4), after_want), (temperature, top_p)
        _same_on_all_ranks(got, group)
        if temperature > 0:  # a sample, not the argmax
            assert not torch.equal(got[8:], finite[8:].argmax(-1))
    with pytest.raises(ValueError, match=r"logits must be this rank's vocabulary shard"):
        sampler(finite)


def _generate_matches_one_process(mesh, args) -> None:
    """generate() with the parallel model gives one process's tokens for the same seed: the
    prefill's token (column 0) and every decode step's, in each sampling mode; its logits,
    gathered, are one process's."""
    prompt = torch.randint(0, args.vocab_size, (BATCH, PROMPT),
                           generator=torch.Generator().manual_seed(5))
    ref, par = _build(args), _build(args, mesh)
    if mesh["tp"].size() > 1:
        assert isinstance(par.sampler, VocabParallelSampler)
        with torch.no_grad():
            shard = par.prefill(prompt, torch.arange(PROMPT))
        assert shard.shape == (BATCH, args.vocab_size // mesh["tp"].size())
        want = ref.prefill(prompt, torch.arange(PROMPT))
        torch.testing.assert_close(full_logits(par, shard), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gather_logits(shard, mesh.get_group("tp")), want,
                                   rtol=1e-5, atol=1e-5)
    greedy = None
    for seed, (temperature, top_p) in enumerate(MODES):
        got = []
        for model in (ref, par):
            model.setup_caches(BATCH, PROMPT + GEN)
            torch.manual_seed(20 + seed)
            got.append(generate(model, prompt, GEN, temperature=temperature, top_p=top_p).tokens)
        assert torch.equal(got[1], got[0]), (temperature, top_p, got)
        _same_on_all_ranks(got[1])
        if temperature == 0:
            greedy = got[0]
        elif top_p == 1.0:
            assert not torch.equal(got[0], greedy)  # it sampled


def _world_of_2(rank, world):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    _sampler_matches_sample(dist.group.WORLD, 128)
    _sampler_matches_sample(dist.group.WORLD, 2 * 97)  # a shard that is not a power of two
    _generate_matches_one_process(ParallelDims(2, 1, world).build_mesh("cpu"), tiny(2))
    _generate_matches_one_process(ParallelDims(2, 1, world).build_mesh("cpu"), tiny(1))  # MQA


def _world_of_4(rank, world):
    torch.set_num_threads(1)
    _sampler_matches_sample(dist.group.WORLD, 128)
    # tp=4 (2 KV heads, each on 2 ranks), and tp=2 x sp=2 (sampling in each tp group).
    _generate_matches_one_process(ParallelDims(4, 1, world).build_mesh("cpu"), tiny(2))
    _generate_matches_one_process(ParallelDims(2, 2, world).build_mesh("cpu"), tiny(2))


def test_vocab_parallel_sampling_tp2():
    run_distributed(_world_of_2, 2)


def test_vocab_parallel_sampling_tp4_and_tp2_x_sp2():
    run_distributed(_world_of_4, 4)
