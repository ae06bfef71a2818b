"""The fp8 (e4m3) KV cache's quantization error, by scale granularity, on the CPU (float32 model).

    .venv/bin/python bench/fp8_kv_error.py          # ~1 min; needs the test extra (transformers)
    .venv/bin/python bench/fp8_kv_error.py --train-steps 1500   # + a small trained Llama (~15 min)

Three granularities of the float32 scale, each with the same e4m3 values (x / scale, saturated):
  tensor:     one scale per layer's K (and V), static: the prompt's amax (new tokens saturate);
  head:       one per (layer, KV head), static likewise;
  token+head: one per (token, KV head), computed as each row is written (longctx.fp8), run
              through longctx's own fp8 cache: plain (kv_smoothing=False), and "smoothed" (the
              model's default: K and V less each sequence's means over its first prefill chunk,
              per KV head and channel, which the attention adds back).
and, as the yardstick, the cache rounded to bfloat16 (what the models' logit margins allow); the
model table adds token+head on K alone and on V alone (the other kept float32): where the error
comes from.
Bytes per element: 1 + 4 / head_dim for token+head, 1 for the others.

Two measurements, against the float32 cache of the same model:
  attention: decode attention over K/V with the channel outliers of real keys (4 channels 5x
      the rest, rows of varying norm), relative error of O (max |dO| / max |O|) against float64;
  model: the small checkpoints transformers writes (tests/checkpoint_utils.save_hf_model: Llama
      and Qwen2, weights N(0, 0.08^2)) and a CodeLlama-width model (dim 8192, head_dim 128, GQA
      64/8, RandomWeights' N(0, 0.02^2), 1 layer), teacher-forced on the float32 model's greedy
      tokens: logits max / mean |difference|, KL(fp32 || fp8) of the next-token distribution and
      top-1 agreement over every decoded position (with the float32 cache's, and with the bf16
      cache's: the issue's yardstick), and the median lead of the float32 top-1 logit over the
      second (how close to a tie these random models decode).
  --train-steps N adds a trained model, whose margins are a trained checkpoint's rather than a
      random one's: a byte-level Llama (transformers, 2 layers, 192 wide, 6/2 heads of 32) trained
      here for N steps on this Python's standard-library source (`trained_llama`), saved with
      save_pretrained and read back like the others, prompted with held-out source.
Prints one markdown table per measurement (for BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.checkpoint_utils, .kv_rounding

from longctx.config import ModelArgs  # noqa: E402
from longctx.decode import decode  # noqa: E402
from longctx.fp8 import FP8, quantize_kv  # noqa: E402
from longctx.parallel.build import build_model  # noqa: E402
from longctx.weights import HFCheckpoint, RandomWeights  # noqa: E402
from tests.kv_rounding import RoundedKVCache, fake_quant, static_amax  # noqa: E402

GRANULARITIES = ("tensor", "head", "token+head")


def attention_error(seed: int = 0) -> dict[str, float]:
    """Relative error of decode attention's output per granularity, K with outlier channels."""
    g = torch.Generator().manual_seed(seed)
    B, S, Hq, Hkv, D = 4, 4096, 32, 8, 128
    k = torch.randn(B, S, Hkv, D, generator=g) * (0.5 + torch.rand(B, S, Hkv, 1, generator=g))
    k[..., torch.randperm(D, generator=g)[:4]] *= 5  # outlier channels, as real keys have
    v = torch.randn(B, S, Hkv, D, generator=g) * (0.5 + torch.rand(B, S, Hkv, 1, generator=g))
    q = torch.randn(B, Hq, D, generator=g)
    want = decode(q.double(), k.double(), v.double())
    out = {}
    for gran in ("bf16", *GRANULARITIES):
        if gran == "bf16":
            got = decode(q.double(), k.bfloat16().double(), v.bfloat16().double())
        elif gran == "token+head":
            (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
            got = decode(q.double(), kq, vq, k_scale=ks, v_scale=vs)
        else:
            kf, vf = fake_quant(k, static_amax(k, gran)), fake_quant(v, static_amax(v, gran))
            got = decode(q.double(), kf.double(), vf.double())
        out[gran] = float((got - want).abs().max() / want.abs().max())
    return out


@torch.no_grad()
def model_error(build, prompt: torch.Tensor, steps: int) -> dict[str, dict[str, float]]:
    """build(make_cache or None, kv_cache_dtype) -> a model; the float32 cache's greedy tokens,
    then each granularity teacher-forced on them."""
    B, P = prompt.shape

    def run(model):
        model.setup_caches(B, P + steps, model.kv_cache_dtype, model.kv_smoothing)
        logits = [model.prefill(prompt, torch.arange(P), chunk=None)]
        for i in range(steps - 1):
            logits.append(model.decode_step(tokens[:, i], torch.full((B,), P + i)))
        return torch.stack(logits).double()  # [steps, B, V]

    ref = build(None, None)
    ref.setup_caches(B, P + steps)
    logits = [ref.prefill(prompt, torch.arange(P))]
    toks = []
    for i in range(steps - 1):
        toks.append(logits[-1].argmax(-1))
        logits.append(ref.decode_step(toks[-1], torch.full((B,), P + i)))
    tokens = torch.stack(toks + [logits[-1].argmax(-1)], dim=1)
    want = torch.stack(logits).double()
    out = {}
    # bf16: the yardstick, the cache rounded to bfloat16; "K only" / "V only": longctx's rule on
    # one of them (emulated in float32), the other kept float32: where the error comes from;
    # True / False: longctx's own fp8 cache, smoothed or not.
    variants = {"bf16": "bf16", "tensor": "tensor", "head": "head", "token+head": False,
                "token+head, K only": ("row", "none"), "token+head, V only": ("none", "row"),
                "token+head, smoothed": True}
    top2 = want.topk(2, dim=-1).values
    margin = float((top2[..., 0] - top2[..., 1]).median())  # the float32 cache's top-1 lead
    bf16_top1 = None
    for gran, fmt in variants.items():
        if isinstance(fmt, bool):  # longctx's own fp8 cache, smoothed or not
            model = build(None, FP8)
            model.kv_smoothing = fmt
        else:
            model = build(functools.partial(RoundedKVCache, fmt=fmt), None)
        got = run(model)
        d = (got - want).abs()
        lp, lq = want.log_softmax(-1), got.log_softmax(-1)
        if gran == "bf16":
            bf16_top1 = got.argmax(-1)
        out[gran] = {"max": float(d.max()), "mean": float(d.mean()),
                     "kl": float((lp.exp() * (lp - lq)).sum(-1).mean()),
                     "top1": float((got.argmax(-1) == want.argmax(-1)).double().mean()),
                     "top1_bf16": float((got.argmax(-1) == bf16_top1).double().mean()),
                     "positions": want.shape[0] * want.shape[1], "margin": margin}
    return out


def _builder(args: ModelArgs, weights):
    def build(make_cache, kv_dtype):
        m = build_model(args, weights=weights, device="cpu", dtype=torch.float32, batch=1,
                        max_seq_len=1)
        if make_cache is not None:
            m.make_cache = make_cache
        m.kv_cache_dtype, m.kv_smoothing = kv_dtype, False
        return m
    return build


BATCH, PROMPT, STEPS = 16, 48, 64  # 1024 positions: one is 0.1% of the agreement


def trained_llama(path: Path, steps: int, seed: int = 0) -> torch.Tensor:
    """A small byte-level LlamaForCausalLM trained for `steps` (AdamW, batches of 16 x 256 bytes,
    cosine schedule) on the top-level .py files of this Python's standard library (sorted, joined),
    saved to `path` by save_pretrained. Returns the held-out last 5% of those bytes (int64), from
    which the prompts come."""
    import transformers
    from tqdm import tqdm

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)),
                            dtype=torch.uint8).long()
    split = int(len(data) * 0.95)
    train = data[:split]
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=192, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=6,
                                   num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                                   rope_theta=1e4, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 50) * 0.5 * (1 + math.cos(math.pi * i / steps)))
    g = torch.Generator().manual_seed(seed)
    bar = tqdm(range(steps), desc="training", unit="step")
    for _ in bar:
        starts = torch.randint(0, len(train) - 257, (16,), generator=g)
        x = torch.stack([train[i:i + 257] for i in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval().save_pretrained(path, safe_serialization=True)
    return data[split:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-steps", type=int, default=0,
                    help="also measure a byte-level Llama trained here for this many steps")
    args = ap.parse_args()
    torch.manual_seed(0)
    print("decode attention, 4 x 4096 keys, 32/8 heads, D=128, 4 outlier channels of K (5x): "
          "max |dO| / max |O| against float64 (bf16: the cache rounded to bfloat16, the yardstick)")
    print("| granularity | bytes / element | relative error |\n|---|---|---|")
    for gran, err in attention_error().items():
        nbytes = {"bf16": 2, "token+head": 1 + 4 / 128}.get(gran, 1)
        print(f"| {gran} | {nbytes:.3f} | {err:.2e} |")

    from tests.checkpoint_utils import save_hf_model

    models = {}
    tmp = Path(tempfile.mkdtemp())
    for name, kw in (("llama (transformers)", {}), ("qwen2 (transformers)", {"model_type": "qwen2"})):
        save_hf_model(tmp / name, **kw)
        ckpt = HFCheckpoint(tmp / name)
        models[name] = (_builder(ckpt.args(), ckpt), 128)
    wide = ModelArgs(name="codellama-width", n_layers=1, dim=8192, n_heads=64, n_kv_heads=8,
                     head_dim=128, intermediate_size=1024, vocab_size=2048, rope_theta=1e6)
    models["CodeLlama width (64/8, D=128, 1 layer)"] = (_builder(wide, RandomWeights(0)), 2048)
    prompts = {}
    if args.train_steps:
        name = f"byte Llama trained {args.train_steps} steps (transformers)"
        held = trained_llama(tmp / "trained", args.train_steps)
        ckpt = HFCheckpoint(tmp / "trained")
        models[name] = (_builder(ckpt.args(), ckpt), 256)
        starts = torch.randint(0, len(held) - PROMPT, (BATCH,),
                               generator=torch.Generator().manual_seed(1))
        prompts[name] = torch.stack([held[i:i + PROMPT] for i in starts.tolist()])
    print(f"\nmodels, teacher-forced on the float32 cache's greedy tokens (batch {BATCH}, prompt "
          f"{PROMPT}, {STEPS} steps; random prompts, held-out source for a trained model): logits "
          "against the float32 cache; 'bf16' rounds the cache to bfloat16 instead")
    print("| model | granularity | max abs | mean abs | KL | top-1 agreement | with the bf16 cache "
          "|\n|---|---|---|---|---|---|---|")
    margins = {}
    for name, (build, vocab) in models.items():
        prompt = prompts.get(name)
        if prompt is None:
            prompt = torch.randint(0, vocab, (BATCH, PROMPT),
                                   generator=torch.Generator().manual_seed(1))
        for gran, r in model_error(build, prompt, STEPS).items():
            margins[name] = r["margin"]
            print(f"| {name} | {gran} | {r['max']:.3e} | {r['mean']:.3e} | {r['kl']:.2e} | "
                  f"{100 * r['top1']:.1f}% of {r['positions']} | {100 * r['top1_bf16']:.1f}% |")
    print("\nmedian lead of the float32 cache's top-1 logit over its second: " + "; ".join(
        f"{name} {m:.3e}" for name, m in margins.items()))


if __name__ == "__main__":
    main()
