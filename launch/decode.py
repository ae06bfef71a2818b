"""Prefill a long context and decode: tokens/s, and how close that is to what the hardware allows.

    python launch/decode.py                       # the tiny model on CPU, in seconds (make demo)
    torchrun --nproc_per_node=8 launch/decode.py +model=codellama34b parallel.tp=8 context_len=32768
    torchrun --nproc_per_node=4 launch/decode.py +model=llama3_8b parallel.tp=2 parallel.sp=2
    torchrun --nproc_per_node=2 launch/decode.py +model=llama3_1_70b parallel.tp=2 context_len=131072
    python launch/decode.py model.checkpoint=<hf llama/qwen2 dir> 'prompt="def quicksort(xs):"' gen_len=64
    python launch/decode.py +model=codellama34b prefill=synthetic context_len=400000  # no prefill

Options: configs/decode.yaml; model presets configs/model/*.yaml (Llama 2 / 3 / 3.1, CodeLlama,
Qwen2.5, with their RoPE scaling and biases). Weights are seeded random (no download) unless
model.checkpoint names a Hugging Face Llama or Qwen2 directory (its config.json then sets the
model, RoPE scaling included). The prompt is prefilled in chunks of prefill_chunk positions, so
the largest context is set by the weights and the KV cache (printed at start-up for the chosen
layout); the prefill is timed warm, after a warm-up call that compiles the kernels. prefill=synthetic skips it: the KV
cache holds seeded random values of the model's K/V scale. Decode is memory-bound, so the report
compares the model's bytes per step (weights once, KV cache once) with GPUs x the HBM read
bandwidth measured at start-up, and also shows the bytes the layout reads. Each run writes
<output>/<timestamp>/ (summary.json, config.yaml, rank<r>.log); the console shows rank 0.
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
import triton  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from longctx.config import ModelArgs, check_chunk, check_decode_config, resolve_dtype  # noqa: E402
from longctx.fp8 import kv_bytes_per_element, resolve_kv_cache_dtype  # noqa: E402
from longctx.generate import Generation, generate, generate_synthetic  # noqa: E402
from longctx.hardware import available_memory, code_commit, read_bandwidth  # noqa: E402
from longctx.parallel.memory import GiB, check_memory, estimate_memory, largest_context  # noqa: E402
from longctx.model import Transformer  # noqa: E402
from longctx.parallel.build import build_model  # noqa: E402
from longctx.parallel.mesh import ParallelDims  # noqa: E402
from longctx.parallel.process_group import init_from_env, rank_and_world  # noqa: E402
from longctx.rope import describe as describe_rope  # noqa: E402
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
    n = torch.get_num_threads()
    return f"CPU ({platform.processor() or platform.machine()}, {n} thread{'s' * (n != 1)})"


def layout_bytes_per_step(model: Transformer, dims: ParallelDims, batch: int,
                          mean_len: float) -> dict[str, float]:
    """Bytes one decode step of this layout reads from memory, summed over all GPUs: every rank's
    weights (the embedding table only for the looked-up rows; tensor-parallel shards once, sp
    replicas each time) and the KV cache at mean_len positions (KV heads replicated under tp
    count once per replica; an fp8 cache's scales included). The model's own bytes are
    ModelArgs.decode_bytes."""
    args, e = model.args, model.lm_head.weight.element_size()
    weights = sum(p.nbytes for n, p in model.named_parameters() if not n.startswith("embed_tokens"))
    weights = (weights + batch * args.dim * e) * dims.world_size
    kv_heads = dims.local_kv_heads(args) * dims.tp
    kv = (2 * args.n_layers * batch * mean_len * kv_heads * args.head_dim
          * kv_bytes_per_element(model.layers[0].self_attn.kv_cache.k_cache.dtype, args.head_dim))
    return {"weights": float(weights), "kv_cache": float(kv), "total": float(weights + kv)}


def summarize(gen: Generation, info: dict, model_bytes: dict, layout_bytes: dict,
              bw_per_device: float, bw_what: str, world: int, prefill_flops: float) -> dict:
    """The run's numbers. The headline share of the limit counts the model's own bytes per step
    (weights once, KV cache once) against GPUs x read bandwidth, the same yardstick for every
    layout; the bytes the layout moves (sp re-reads the weights on each rank, tp beyond the KV
    heads re-reads them) are the second figure."""
    B, P, n = info["batch"], info["prompt_len"], len(gen.step_s)
    steps = torch.tensor(gen.step_s, dtype=torch.float64)
    mean_s = float(steps.mean())
    limit = world * bw_per_device
    real = gen.prefill_s is not None
    return {
        **info,
        "prefill": "real" if real else "synthetic (random KV cache)",
        "prefill_warmup_s": gen.warmup_s,  # first call: compiling the kernels + warm-up prefill
        "prefill_warmup_len": gen.warmup_len,
        "prefill_s": gen.prefill_s,  # warm
        "prefill_tokens_per_s": B * P / gen.prefill_s if real else None,
        "prefill_flops": prefill_flops if real else None,
        "prefill_tflops_per_gpu": prefill_flops / gen.prefill_s / world / 1e12 if real else None,
        "synthetic_fill_s": gen.fill_s,
        "decode_steps": n,
        "decode_tokens_per_s": B * n / float(steps.sum()),
        "ms_per_token_p50": 1e3 * float(steps.quantile(0.5)),
        "ms_per_token_p90": 1e3 * float(steps.quantile(0.9)),
        "ms_per_step": [round(1e3 * t, 4) for t in gen.step_s],  # in order: where a p90 comes from
        "read_bandwidth_Bps_per_device": bw_per_device,
        "read_bandwidth_measured_as": bw_what,
        # Headline: the model's bytes per step / (mean step time x devices x read bandwidth).
        "model_bytes_per_step": model_bytes,
        "achieved_bandwidth_Bps": model_bytes["total"] / mean_s,
        "pct_of_bandwidth_limit": 100 * model_bytes["total"] / mean_s / limit,
        # What this layout reads per step over all devices, and that rate's share of the same.
        "layout_bytes_per_step": layout_bytes,
        "layout_bandwidth_Bps": layout_bytes["total"] / mean_s,
        "layout_pct_of_bandwidth_limit": 100 * layout_bytes["total"] / mean_s / limit,
    }


def _si(x: float, unit: str) -> str:
    """1.23e9, "B" -> '1.23 GB'."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def report(s: dict) -> None:
    mb, lb = s["model_bytes_per_step"], s["layout_bytes_per_step"]
    if s["prefill_s"] is not None:
        chunk, P = s["prefill_chunk"], s["prompt_len"]
        calls = -(-P // chunk) if chunk else 1
        prefill = (f"real, {f'{calls} chunks of {chunk}' if calls > 1 else '1 call'}: "
                   f"{s['prefill_s']:.3f} s warm, {s['prefill_tokens_per_s']:,.0f} tokens/s, "
                   f"{s['prefill_tflops_per_gpu']:.3g} TFLOPS per device")
        if s["prefill_warmup_s"] is not None:
            prefill += (f"\n            first call {s['prefill_warmup_s']:.3f} s (compile + "
                        f"warm-up prefill of {s['prefill_warmup_len']} positions)")
    else:
        prefill = (f"synthetic (random KV cache): no prefill, {s['prompt_len']} positions filled "
                   f"in {s['synthetic_fill_s']:.3f} s")
    peak = s.get("peak_memory_bytes")
    log.info(
        f"\n{s['model']} {s['dtype']} (KV cache {s['kv_cache_dtype']}) | {s['world_size']} x "
        f"{s['device']} (tp={s['tp']}, "
        f"sp={s['sp']}) | batch {s['batch']}, context {s['prompt_len']}, "
        f"{s['decode_steps']} decode steps, CUDA graphs {'on' if s['cuda_graphs'] else 'off'}\n"
        f"prefill     {prefill}\n"
        f"decode      {s['decode_tokens_per_s']:,.1f} tokens/s, ms/token p50 "
        f"{s['ms_per_token_p50']:.3f}, p90 {s['ms_per_token_p90']:.3f}\n"
        f"limit       {s['pct_of_bandwidth_limit']:.1f}% of {s['world_size']} x "
        f"{_si(s['read_bandwidth_Bps_per_device'], 'B/s')}: the model's "
        f"{_si(mb['total'], 'B')}/step (weights {_si(mb['weights'], 'B')} + KV cache "
        f"{_si(mb['kv_cache'], 'B')}) at {_si(s['achieved_bandwidth_Bps'], 'B/s')}\n"
        f"layout      {s['layout_pct_of_bandwidth_limit']:.1f}%: reads "
        f"{_si(lb['total'], 'B')}/step over all devices (weights {_si(lb['weights'], 'B')} + "
        f"KV cache {_si(lb['kv_cache'], 'B')}) at {_si(s['layout_bandwidth_Bps'], 'B/s')}"
        + (f"\nmemory      peak {peak / GiB:.2f} GiB allocated on the fullest device (estimate "
           f"{s['memory_estimate_bytes']['total'] / GiB:.2f} GiB)" if peak is not None else ""))


def run(cfg: DictConfig, device: torch.device, rank: int, world: int, run_dir: Path,
        dims: ParallelDims, args: ModelArgs, ckpt: HFCheckpoint | None) -> None:
    dtype = resolve_dtype(cfg.dtype, device)
    kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, dtype)
    torch.manual_seed(cfg.seed)  # sampling: the same draws on every rank
    if rank == 0:
        OmegaConf.save(cfg, run_dir / "config.yaml")
    B = cfg.batch
    synthetic = cfg.prefill == "synthetic"
    chunk = check_chunk(cfg.prefill_chunk, 1 if synthetic else dims.sp)
    tokenizer = ckpt.tokenizer() if cfg.prompt else None
    prompt = None
    if tokenizer is not None:
        prompt = torch.tensor(tokenizer.encode(cfg.prompt).ids, dtype=torch.int64).repeat(B, 1)
        if prompt.shape[1] == 0:
            raise ValueError(f"prompt {cfg.prompt!r} gives no tokens with {ckpt.path}/tokenizer.json")
    elif not synthetic:
        gen_cpu = torch.Generator().manual_seed(cfg.seed)
        prompt = torch.randint(0, args.vocab_size, (B, cfg.context_len), generator=gen_cpu)
    P = cfg.context_len if synthetic else prompt.shape[1]
    max_seq_len = P + cfg.gen_len
    cuda_graphs = bool(cfg.cuda_graphs) and device.type == "cuda"
    info = {"model": args.name, "params": args.num_params(), "dtype": str(dtype).removeprefix("torch."),
            "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
            "kv_cache_smoothing": bool(cfg.get("kv_cache_smoothing", True)) and kv_dtype != dtype,
            "device": device_name(device), "world_size": world, "tp": dims.tp, "sp": dims.sp,
            "batch": B, "prompt_len": P, "gen_len": cfg.gen_len, "prefill_chunk": chunk,
            "cuda_graphs": cuda_graphs, "rope_scaling": describe_rope(args.rope_scaling),
            "qkv_bias": args.qkv_bias, "commit": code_commit(), "torch": torch.__version__,
            "triton": triton.__version__}
    log.info(f"run directory {run_dir}")
    n = info["params"]
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    log.info(f"{args.name}: {size} parameters, {info['dtype']} (KV cache "
             f"{info['kv_cache_dtype']}{', smoothed' if info['kv_cache_smoothing'] else ''}), "
             f"{world} x "
             f"{info['device']}, tp={dims.tp} sp={dims.sp}, batch {B}, "
             f"{'synthetic KV cache of' if synthetic else 'prompt'} {P} tokens, "
             f"{cfg.gen_len} generated; rope scaling {info['rope_scaling']}"
             + (", q/k/v biases" if args.qkv_bias else ""))

    bw, bw_what = read_bandwidth(device)
    if world > 1:  # the mean over devices: world x mean is their sum
        t = torch.tensor([bw], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        bw = float(t) / world
    log.info(f"read bandwidth {_si(bw, 'B/s')} per device: {bw_what}")

    available = int(cfg.memory_gb * GiB) if cfg.memory_gb is not None else available_memory(device)
    where = f"{device} (memory_gb={cfg.memory_gb})" if cfg.memory_gb is not None else str(device)
    plan = dict(batch=B, dtype=dtype, device_type=device.type, prefill_chunk=chunk,
                kv_cache_dtype=kv_dtype, kv_smoothing=info["kv_cache_smoothing"])
    largest = largest_context(args, tp=dims.tp, sp=dims.sp, available=available,
                              gen_len=cfg.gen_len, synthetic=synthetic, **plan)
    info["largest_context_len"] = largest
    log.info(largest_context_line(args, dims, largest, available, cfg.gen_len, synthetic, plan))
    est = check_memory(args, tp=dims.tp, sp=dims.sp, available=available, where=where,
                       prompt_len=0 if synthetic else P, max_seq_len=max_seq_len, **plan)
    log.info(f"memory per device: about {est.total / GiB:.2f} GiB ({est.breakdown()}) of "
             f"{available / GiB:.2f} GiB available")

    t0 = time.perf_counter()
    model = build_model(args, weights=ckpt or RandomWeights(cfg.seed), device=device, dtype=dtype,
                        batch=B, max_seq_len=max_seq_len, mesh=dims.build_mesh(device.type),
                        all_reduce=cfg.parallel.all_reduce, kv_cache_dtype=kv_dtype,
                        kv_smoothing=info["kv_cache_smoothing"])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    log.info(f"model built in {time.perf_counter() - t0:.2f} s "
             f"({'checkpoint ' + str(ckpt.path) if ckpt else f'random weights, seed {cfg.seed}'})")

    sampling = dict(temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                    cuda_graph=cuda_graphs, progress=rank == 0)
    if synthetic:
        # Each rank its own cache values; the first token the same on every rank.
        gen = generate_synthetic(model, P, cfg.gen_len, batch=B, seed=cfg.seed,
                                 cache_seed=cfg.seed * 1_000_003 + rank, **sampling)
    else:
        gen = generate(model, prompt.to(device), cfg.gen_len, prefill_chunk=chunk, warm_up=True,
                       **sampling)
    mean_len = P + cfg.gen_len / 2  # decode steps attend to P+1 ... P+gen_len-1 positions
    e = model.lm_head.weight.element_size()
    summary = summarize(gen, info,
                        args.decode_bytes(B, mean_len, e, kv_bytes_per_element(kv_dtype, args.head_dim)),
                        layout_bytes_per_step(model, dims, B, mean_len), bw, bw_what, world,
                        args.prefill_flops(B, P))
    summary["memory_estimate_bytes"] = {"weights": est.weights, "kv_cache": est.kv_cache,
                                        "rope": est.rope, "activations": est.activations,
                                        "reserve": est.reserve, "total": est.total}
    summary.update(peak_memory(device, world))
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


def largest_context_line(args: ModelArgs, dims: ParallelDims, largest: int, available: int,
                         gen_len: int, synthetic: bool, plan: dict) -> str:
    """One line: the largest context_len that fits this layout here, and what sets it."""
    est = estimate_memory(args, tp=dims.tp, sp=dims.sp, prompt_len=0 if synthetic else largest,
                          max_seq_len=largest + gen_len, **plan)
    per_position = (est.kv_cache + est.rope) / max(largest + gen_len, 1)
    return (f"largest context that fits tp={dims.tp} sp={dims.sp} on this device: {largest:,} "
            f"tokens ({available / GiB:.2f} GiB = weights {est.weights / GiB:.2f} + reserve "
            f"{est.reserve / GiB:.2f} + {'decode' if synthetic else 'prefill'} activations "
            f"{est.activations / GiB:.2f} GiB + {per_position / 1024:.1f} KiB per position: KV "
            f"cache x batch {plan['batch']}, RoPE)")


def peak_memory(device: torch.device, world: int) -> dict:
    """Peak bytes allocated and reserved by torch on the fullest device since the model was
    built (CUDA; None elsewhere)."""
    if device.type != "cuda":
        return {"peak_memory_bytes": None, "peak_memory_reserved_bytes": None}
    t = torch.tensor([torch.cuda.max_memory_allocated(device),
                      torch.cuda.max_memory_reserved(device)], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"peak_memory_bytes": int(t[0]), "peak_memory_reserved_bytes": int(t[1])}


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
    check_chunk(cfg.prefill_chunk, 1 if cfg.prefill == "synthetic" else dims.sp)

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
