"""Development variant of bench/prefetch_step.py: each GEMV program prefetching its own rows
(--names: own_all, own_132, own_264, own_528: the first that many programs), and the push
all-reduce releasing the next GEMV at its start (early). Decode-step time of CodeLlama-34B as each batch-1 GEMV asks L2 for more or fewer of the next
GEMV's first bytes (`Transformer.chain_prefetch`), the variants interleaved in rounds on one
model, each captured in its own CUDA graph.

    python bench/prefetch_step.py [--context 16384] [--mb 0 8 16 24 32] [--rounds 3]
    torchrun --nproc_per_node=2 bench/prefetch_step.py ...   # tensor-parallel over the ranks
    python bench/prefetch_step.py --shard                    # a tp=2 rank's shapes on one GPU

Random weights, bf16, batch 1, a synthetic KV cache of `context` positions. Prints, per variant,
the median step over the rounds (each round the median of `steps` replays) and its share of the
limit: the model's weight and KV bytes per step over the GPUs' summed read bandwidth, as
launch/decode.py counts it. --chunks also varies the bytes per prefetch instruction.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

import longctx.kernels.utils as kutils
from longctx.config import ModelArgs
from longctx.generate import DecodeStep
from longctx.hardware import read_bandwidth
from longctx.parallel.build import build_model
from longctx.parallel.mesh import ParallelDims
from longctx.weights import RandomWeights


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--mb", type=float, nargs="+", default=[0, 8, 16, 24, 32],
                    help="MiB of the next weight each GEMV prefetches (0: none)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[kutils.PREFETCH_CHUNK],
                    help="bytes per prefetch instruction")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--names", nargs="+", default=["base"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--shard", action="store_true", help="a tp=2 rank's shapes, one GPU")
    a = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    if world > 1:
        dist.init_process_group("nccl", device_id=dev)
    half = 2 if a.shard else 1
    args = ModelArgs(name="codellama34b" + ("-tp2-shard" if a.shard else ""), n_layers=48,
                     dim=8192, n_heads=64 // half, n_kv_heads=8 // half, head_dim=128,
                     intermediate_size=22016 // half, vocab_size=32000 // half, rope_theta=1e6)
    dims = ParallelDims(world, 1, world)
    model = build_model(args, weights=RandomWeights(0), device=dev, dtype=torch.bfloat16,
                        batch=1, max_seq_len=a.context + a.steps * a.rounds * 4 + 64,
                        mesh=dims.build_mesh("cuda"), l2_prefetch=0)
    model.fill_random_cache(a.context, rank)
    bw, _ = read_bandwidth(dev)
    step_bytes = args.decode_bytes(1, a.context, 2)["total"]
    limit_ms = step_bytes / (bw * world) * 1e3
    say = print if rank == 0 else (lambda *x, **k: None)
    say(f"{args.name}, {world} GPU(s) ({torch.cuda.get_device_name(dev)}), context {a.context}: "
        f"{step_bytes / 1e9:.2f} GB/step at {bw / 1e12:.2f} TB/s per GPU: limit {limit_ms:.3f} ms")

    import longctx.kernels.gemv as G
    import longctx.kernels.allreduce as AR
    V = {"base": {}, "own_all": {"own": -1}, "own_132": {"own": 132}, "own_264": {"own": 264},
         "own_528": {"own": 528}, "early": {"early": True}, "early_own_264": {"early": True, "own": 264},
         "early_own_all": {"early": True, "own": -1}, "own_264_c16k": {"own": 264, "chunk": 16384},
         "own_264_c2k": {"own": 264, "chunk": 2048}}
    variants = [(n, 0) for n in a.names]
    times: dict[tuple[float, int], list[float]] = {v: [] for v in variants}
    first = torch.zeros(1, dtype=torch.int64, device=dev)
    pos = a.context
    with torch.no_grad():
        for _ in range(a.rounds):
            for mb, chunk in variants:
                v = V[mb]
                G.OWN_PROGRAMS = v.get("own", 0)
                G.OWN_CHUNK = v.get("chunk", 4096)
                AR.EARLY = v.get("early", False)
                step = DecodeStep(model, first, pos, a.steps + 8, temperature=0.0, top_p=1.0,
                                  cuda_graph=True)
                for _ in range(3):
                    step()
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(a.steps + 1)]
                for i in range(a.steps):
                    ev[i].record()
                    step()
                ev[-1].record()
                torch.cuda.synchronize()
                times[(mb, chunk)].append(statistics.median(
                    x.elapsed_time(y) for x, y in zip(ev[:-1], ev[1:])))
                del step
    base = statistics.median(times[variants[0]])
    say(f"\n| prefetch MiB | bytes/instr | ms/step (median of {a.rounds} rounds) | rounds | "
        f"% of limit | vs first |\n|---|---|---|---|---|---|")
    for (mb, chunk), ts in times.items():
        ms = statistics.median(ts)
        say(f"| {mb} | - | {ms:.3f} | {' '.join(f'{t:.3f}' for t in ts)} "
            f"| {limit_ms / ms * 100:.1f}% | {base / ms:.3f}x |")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
