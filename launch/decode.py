"""Prefill a long context and decode: tokens/s, and how close that is to what the hardware allows.

    python launch/decode.py                       # the tiny model on CPU, in seconds (make demo)
    torchrun --nproc_per_node=8 launch/decode.py +model=codellama34b parallel.tp=8 context_len=32768
    torchrun --nproc_per_node=4 launch/decode.py +model=llama3_8b parallel.tp=2 parallel.sp=2
    python launch/decode.py model.checkpoint=<hf llama dir> prompt="def quicksort(xs):" gen_len=64

Options: configs/decode.yaml. Weights are seeded random (no download) unless model.checkpoint is
given. Decode is memory-bound, so the report counts the bytes each step reads across all GPUs
(weights, KV cache) and compares the time against GPUs x the HBM read bandwidth measured at
start-up. Each run writes <output>/<timestamp>/ (summary.json, config.yaml, rank<r>.log); the
console shows rank 0.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
from datetime import datetime
from pathlib import Path

os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # full tracebacks, never a shortened report

import hydra  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from longctx.config import ModelArgs, check_decode_config, resolve_dtype  # noqa: E402
from longctx.generate import Generation, generate  # noqa: E402
from longctx.hardware import available_memory, code_commit, read_bandwidth  # noqa: E402
from longctx.parallel.memory import GiB, check_memory  # noqa: E402
from longctx.model import Transformer  # noqa: E402
from longctx.parallel.build import build_model  # noqa: E402
from longctx.parallel.mesh import ParallelDims  # noqa: E402
from longctx.parallel.process_group import init_from_env, rank_and_world  # noqa: E402
from longctx.weights import HFCheckpoint, RandomWeights  # noqa: E402

log = logging.getLogger("longctx")


def make_run_dir(output: str, rank: int, world: int) -> Path:
    """One directory per run, shared by all ranks: rank 0 creates <output>/<timestamp>[-n] and
    broadcasts its name."""
    name: list[str | None] = [None]
    if rank == 0:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path, n = Path(output) / stamp, 0
        while True:
            try:
                path.mkdir(parents=True)
                break
            except FileExistsError:  # two runs in one second
                n += 1
                path = Path(output) / f"{stamp}-{n}"
        name = [str(path)]
    if world > 1:
        dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def setup_logging(run_dir: Path, rank: int) -> None:
    """A log file per rank; the console shows rank 0 only."""
    log.setLevel(logging.INFO)
    log.propagate = False
    fh = logging.FileHandler(run_dir / f"rank{rank}.log")
    fh.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s"))
    log.addHandler(fh)
    if rank == 0:
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(sh)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def bytes_per_step(model: Transformer, dims: ParallelDims, batch: int, prompt_len: int,
                   gen_len: int) -> dict[str, float]:
    """Bytes one decode step reads from memory, summed over all GPUs: every rank's weights (the
    embedding table only for the looked-up rows; tensor-parallel shards once, sp replicas each
    time) and the KV cache at the mean length of the decode steps (positions P+1 ... P+gen_len-1;
    KV heads replicated under tp count once per replica)."""
    args, e = model.args, model.lm_head.weight.element_size()
    weights = sum(p.nbytes for n, p in model.named_parameters() if not n.startswith("embed_tokens"))
    weights = (weights + batch * args.dim * e) * dims.world_size
    mean_len = prompt_len + gen_len / 2
    kv_heads = dims.local_kv_heads(args) * dims.tp
    kv = 2 * args.n_layers * batch * mean_len * kv_heads * args.head_dim * e
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def summarize(gen: Generation, info: dict, moved: dict, bw_per_device: float, bw_what: str,
              world: int) -> dict:
    B, P, n = info["batch"], info["prompt_len"], len(gen.step_s)
    steps = torch.tensor(gen.step_s, dtype=torch.float64)
    mean_s = float(steps.mean())
    achieved = moved["total"] / mean_s
    return {
        **info,
        "prefill_s": gen.prefill_s,
        "prefill_tokens_per_s": B * P / gen.prefill_s,
        "decode_steps": n,
        "decode_tokens_per_s": B * n / float(steps.sum()),
        "ms_per_token_p50": 1e3 * float(steps.quantile(0.5)),
        "ms_per_token_p90": 1e3 * float(steps.quantile(0.9)),
        "bytes_per_step": moved,
        "achieved_bandwidth_Bps": achieved,
        "read_bandwidth_Bps_per_device": bw_per_device,
        "read_bandwidth_measured_as": bw_what,
        # The floor: bytes per step / (devices x read bandwidth), against the mean step time.
        "pct_of_bandwidth_limit": 100 * achieved / (world * bw_per_device),
    }


def _si(x: float, unit: str) -> str:
    """1.23e9, "B" -> '1.23 GB'."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def report(s: dict) -> None:
    moved = s["bytes_per_step"]
    log.info(
        f"\n{s['model']} {s['dtype']} | {s['world_size']} x {s['device']} (tp={s['tp']}, "
        f"sp={s['sp']}) | batch {s['batch']}, prompt {s['prompt_len']}, "
        f"{s['decode_steps']} decode steps, CUDA graphs {'on' if s['cuda_graphs'] else 'off'}\n"
        f"prefill     {s['prefill_s']:.3f} s, {s['prefill_tokens_per_s']:,.0f} tokens/s"
        f"{'' if s['device'].startswith('CPU') else ' (first call: includes compiling the Triton kernels)'}\n"
        f"decode      {s['decode_tokens_per_s']:,.1f} tokens/s, ms/token p50 "
        f"{s['ms_per_token_p50']:.3f}, p90 {s['ms_per_token_p90']:.3f}\n"
        f"bytes/step  {_si(moved['total'], 'B')} over all devices (weights "
        f"{_si(moved['weights'], 'B')} + KV cache {_si(moved['kv_cache'], 'B')})\n"
        f"bandwidth   {_si(s['achieved_bandwidth_Bps'], 'B/s')} achieved = "
        f"{s['pct_of_bandwidth_limit']:.1f}% of {s['world_size']} x "
        f"{_si(s['read_bandwidth_Bps_per_device'], 'B/s')} ({s['read_bandwidth_measured_as']})")


def run(cfg: DictConfig, device: torch.device, rank: int, world: int, run_dir: Path,
        dims: ParallelDims, args: ModelArgs, ckpt: HFCheckpoint | None) -> None:
    dtype = resolve_dtype(cfg.dtype, device)
    torch.manual_seed(cfg.seed)  # sampling: the same draws on every rank
    if rank == 0:
        OmegaConf.save(cfg, run_dir / "config.yaml")
    B = cfg.batch
    tokenizer = ckpt.tokenizer() if cfg.prompt else None
    if tokenizer is not None:
        prompt = torch.tensor(tokenizer.encode(cfg.prompt).ids, dtype=torch.int64).repeat(B, 1)
        if prompt.shape[1] == 0:
            raise ValueError(f"prompt {cfg.prompt!r} gives no tokens with {ckpt.path}/tokenizer.json")
    else:
        gen_cpu = torch.Generator().manual_seed(cfg.seed)
        prompt = torch.randint(0, args.vocab_size, (B, cfg.context_len), generator=gen_cpu)
    P = prompt.shape[1]
    max_seq_len = P + cfg.gen_len
    cuda_graphs = bool(cfg.cuda_graphs) and device.type == "cuda"
    info = {"model": args.name, "params": args.num_params(), "dtype": str(dtype).removeprefix("torch."),
            "device": device_name(device), "world_size": world, "tp": dims.tp, "sp": dims.sp,
            "batch": B, "prompt_len": P, "gen_len": cfg.gen_len, "cuda_graphs": cuda_graphs,
            "commit": code_commit(), "torch": torch.__version__}
    log.info(f"run directory {run_dir}")
    n = info["params"]
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    log.info(f"{args.name}: {size} parameters, {info['dtype']}, {world} x "
             f"{info['device']}, tp={dims.tp} sp={dims.sp}, batch {B}, prompt {P} tokens, "
             f"{cfg.gen_len} generated")

    bw, bw_what = read_bandwidth(device)
    if world > 1:  # the mean over devices: world x mean is their sum
        t = torch.tensor([bw], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        bw = float(t) / world
    log.info(f"read bandwidth {_si(bw, 'B/s')} per device: {bw_what}")

    available = int(cfg.memory_gb * GiB) if cfg.memory_gb is not None else available_memory(device)
    where = f"{device} (memory_gb={cfg.memory_gb})" if cfg.memory_gb is not None else str(device)
    est = check_memory(args, tp=dims.tp, sp=dims.sp, available=available, where=where, batch=B,
                       prompt_len=P, max_seq_len=max_seq_len, dtype=dtype, device_type=device.type)
    log.info(f"memory per device: about {est.total / GiB:.2f} GiB ({est.breakdown()}) of "
             f"{available / GiB:.2f} GiB available")

    t0 = time.perf_counter()
    model = build_model(args, weights=ckpt or RandomWeights(cfg.seed), device=device, dtype=dtype,
                        batch=B, max_seq_len=max_seq_len, mesh=dims.build_mesh(device.type))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info(f"model built in {time.perf_counter() - t0:.2f} s "
             f"({'checkpoint ' + str(ckpt.path) if ckpt else f'random weights, seed {cfg.seed}'})")

    gen = generate(model, prompt.to(device), cfg.gen_len, temperature=cfg.sampling.temperature,
                   top_p=cfg.sampling.top_p, cuda_graph=cuda_graphs, progress=rank == 0)
    moved = bytes_per_step(model, dims, B, P, cfg.gen_len)
    summary = summarize(gen, info, moved, bw, bw_what, world)
    summary["memory_estimate_bytes"] = {"weights": est.weights, "kv_cache": est.kv_cache,
                                        "activations": est.activations}
    summary["tokens"] = gen.tokens[0].tolist()
    if tokenizer is not None:
        summary["text"] = tokenizer.decode(summary["tokens"])
        log.info(f"generated: {summary['text']!r}")
    report(summary)
    if rank == 0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        log.info(f"wrote {run_dir / 'summary.json'}")
    if cfg.profile:
        profile_decode(model, gen.tokens[:, -1].to(device), max_seq_len - 1, device, run_dir, rank)


def profile_decode(model, tokens: torch.Tensor, pos: int, device: torch.device, run_dir: Path,
                   rank: int, steps: int = 3) -> None:
    """Where a decode step's time goes: torch.profiler over `steps` eager decode steps (no CUDA
    graph, so launch gaps show too) at position `pos`; the kernel table by self device time goes
    to <run_dir>/profile_rank<r>.txt, and its top rows to the console. Without programmatic
    dependent launch: with it a kernel's device time would include waiting for its predecessor."""
    from torch.profiler import ProfilerActivity, profile

    from longctx.kernels.utils import pdl_off

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    input_pos = torch.full((tokens.shape[0],), pos, dtype=torch.int64, device=device)
    with torch.no_grad(), pdl_off():
        model.decode_step(tokens, input_pos)  # warm-up outside the profile
        if cuda:
            torch.cuda.synchronize(device)
        with profile(activities=acts) as prof:
            for _ in range(steps):
                model.decode_step(tokens, input_pos)
            if cuda:
                torch.cuda.synchronize(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=30)
    out = run_dir / f"profile_rank{rank}.txt"
    out.write_text(f"{steps} eager decode steps at position {pos}, sorted by {key}\n{table}\n")
    log.info(f"profile of {steps} eager decode steps (by {key}):\n"
             + "\n".join(table.splitlines()[:16]) + f"\nfull table: {out}")


@hydra.main(config_path="../configs", config_name="decode", version_base="1.3")
def main(cfg: DictConfig) -> None:
    # Configuration errors surface before any process group or device is touched.
    check_decode_config(cfg)
    dims = ParallelDims.from_env(cfg.parallel.tp, cfg.parallel.sp)
    ckpt = HFCheckpoint(cfg.model.checkpoint) if cfg.model.checkpoint else None
    args = ckpt.args() if ckpt else ModelArgs.from_config(cfg.model)
    dims.check_model(args)

    device = init_from_env()  # nccl on cuda:LOCAL_RANK, or gloo on the CPU
    rank, world = rank_and_world()
    run_dir = make_run_dir(cfg.output, rank, world)
    setup_logging(run_dir, rank)
    try:
        run(cfg, device, rank, world, run_dir, dims, args, ckpt)
    except BaseException:
        log.exception("run failed")  # into this rank's log file too; then re-raised
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
