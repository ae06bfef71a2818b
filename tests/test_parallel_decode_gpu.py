"""tp=2 and sp=2 decoding on two GPUs (NCCL, bf16, CUDA graphs) against one GPU:

- logits: the prefill's and those of several decode steps replayed from a CUDA graph are as close
  to a float32 reference (the same bf16 weights, on the CPU) as twice the error of the tp=1 bf16
  model on one GPU, step by step;
- tokens: the vocabulary-parallel sampler, captured in generate()'s CUDA graph, gives for a given
  seed the tokens of the sampling it replaced (the LM head's logits gathered, then `sample`), in
  every mode, on both ranks alike. (tp=1 and tp=2 in bf16 have different logits -- the first
  check bounds how different -- so their tokens may legitimately differ at near-ties.)

    pytest -q -s tests/test_parallel_decode_gpu.py      # on a machine with 2 GPUs
"""

import pytest
import torch
import torch.distributed as dist

from longctx.config import ModelArgs
from longctx.generate import generate, sample
from longctx.parallel.build import build_model
from longctx.parallel.mesh import ParallelDims
from longctx.parallel.sampling import VocabParallelSampler, full_logits, gather_logits
from longctx.weights import RandomWeights
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.gpu

# CodeLlama-34B's head_dim, GQA group (8) and vocabulary; 2 layers of a narrower model (at tp=2
# one KV head per rank, as CodeLlama-34B's at tp=8).
ARGS = ModelArgs(n_layers=2, dim=2048, n_heads=16, n_kv_heads=2, head_dim=128,
                 intermediate_size=5632, vocab_size=32000, rope_theta=1e6, name="test-gpu")
PROMPT, STEPS = 301, 6  # 301: odd, so sp=2's prefill ends with a round-robin tail
MODES = [(0.0, 1.0), (0.8, 1.0), (0.8, 0.9)]  # greedy, temperature, temperature + top_p


def _build(device, dtype, batch, mesh=None):
    return build_model(ARGS, weights=RandomWeights(seed=3), device=device, dtype=dtype,
                       batch=batch, max_seq_len=PROMPT + STEPS + 1, mesh=mesh)


def _graph_steps(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Teacher-forced decode steps replayed from one CUDA graph: tokens [B, STEPS] fed at
    positions PROMPT, PROMPT + 1, ... -> each step's full logits [B, V] float32."""
    B, dev = tokens.shape[0], tokens.device
    tok, pos = tokens[:, 0].clone(), torch.full((B,), PROMPT, device=dev)

    def step():
        return full_logits(model, model.decode_step(tok, pos))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up outside the capture; writes slot PROMPT, rewritten below
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step()
    out = []
    for i in range(STEPS):
        tok.copy_(tokens[:, i])
        pos.fill_(PROMPT + i)
        graph.replay()
        out.append(logits.clone())
    return out


def _run(model, prompt, tokens, graph: bool) -> list[torch.Tensor]:
    """[prefill logits, step logits ...] on the CPU, float32."""
    dev = prompt.device
    with torch.no_grad():
        first = full_logits(model, model.prefill(prompt, torch.arange(PROMPT, device=dev)))
        if graph:
            steps = _graph_steps(model, tokens)
        else:
            steps = [full_logits(model, model.decode_step(
                tokens[:, i], torch.full((tokens.shape[0],), PROMPT + i, device=dev)))
                for i in range(STEPS)]
    return [t.float().cpu() for t in [first, *steps]]


def _same_on_all_ranks(t: torch.Tensor) -> None:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    assert all(torch.equal(e, t) for e in everyone)


def _logits_match(rank, world, batch):
    device = torch.device("cuda", rank)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, ARGS.vocab_size, (batch, PROMPT), generator=g)
    tokens = torch.randint(0, ARGS.vocab_size, (batch, STEPS), generator=g)
    one = _build(device, torch.bfloat16, batch)
    ref = _build("cpu", torch.float32, batch)
    ref.load_state_dict({k: v.float().cpu() for k, v in one.state_dict().items()})
    want = _run(ref, prompt, tokens, graph=False)
    base = _run(one, prompt.to(device), tokens.to(device), graph=True)
    del one
    for name, dims in (("tp=2", ParallelDims(2, 1, world)), ("sp=2", ParallelDims(1, 2, world))):
        par = _build(device, torch.bfloat16, batch, dims.build_mesh("cuda"))
        got = _run(par, prompt.to(device), tokens.to(device), graph=True)
        for i, (gt, b, w) in enumerate(zip(got, base, want)):
            err, bar = (gt - w).abs().max().item(), (b - w).abs().max().item()
            what = "prefill" if i == 0 else f"step {i}"
            if rank == 0:  # shown with pytest -s
                print(f"batch {batch} {name} {what}: max |logits - fp32| {err:.3e}, "
                      f"tp=1 bf16 {bar:.3e}")
            assert 0 < bar and err <= 2 * bar, f"{name} {what}: {err:.3e} > 2 x {bar:.3e}"
            _same_on_all_ranks(gt.to(device))
        del par


def _tokens_match_gathered_sampling(rank, world, batch):
    device = torch.device("cuda", rank)
    mesh = ParallelDims(2, 1, world).build_mesh("cuda")
    par = _build(device, torch.bfloat16, batch, mesh)
    sampler, group = par.sampler, mesh.get_group("tp")
    assert isinstance(sampler, VocabParallelSampler)

    def gathering(logits, temperature, top_p):  # what tensor parallelism sampled before
        return sample(gather_logits(logits, group), temperature, top_p)

    prompt = torch.randint(0, ARGS.vocab_size, (batch, PROMPT),
                           generator=torch.Generator().manual_seed(12)).to(device)
    for seed, (temperature, top_p) in enumerate(MODES):
        got = []
        for s in (sampler, gathering):
            par.sampler = s
            torch.manual_seed(40 + seed)
            got.append(generate(par, prompt, STEPS + 1, temperature=temperature, top_p=top_p,
                                cuda_graph=True).tokens)
        par.sampler = sampler
        assert torch.equal(got[0], got[1]), (temperature, top_p, got)
        _same_on_all_ranks(got[0].to(device))


def _worker(rank, world):
    for batch in (1, 3):  # batch 1: the GEMV kernels; 3: torch's GEMM
        _logits_match(rank, world, batch)
        _tokens_match_gathered_sampling(rank, world, batch)


def test_tp2_and_sp2_decode_match_one_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    run_distributed(_worker, 2, backend="nccl")
