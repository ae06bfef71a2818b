"""The transformers peer for launch/decode.py: Hugging Face LlamaForCausalLM (Qwen2ForCausalLM
for a preset with qkv_bias; SDPA attention, StaticCache) on the same random-weight architecture
and RoPE scaling, one GPU, greedy, eager forward calls.

    python bench/hf_peer.py --model codellama34b --context 16384 --gen 64

Prefill once, then `gen` single-token forward calls into the static cache; decode tokens/s is
timed over those calls (median ms/token reported too). `generate(cache_implementation=
"static")` is not used: it compiles per cache length, so its timing would include recompiles.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import yaml


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="codellama34b", help="a configs/model/*.yaml name")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    m = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs/model" / f"{a.model}.yaml").read_text())
    # Qwen2: q/k/v biases, head_dim = dim / n_heads (its config has no head_dim field).
    Config, Model = (Qwen2Config, Qwen2ForCausalLM) if m.get("qkv_bias") else (LlamaConfig,
                                                                               LlamaForCausalLM)
    extra = {} if m.get("qkv_bias") else {"head_dim": m["head_dim"]}
    cfg = Config(hidden_size=m["dim"], intermediate_size=m["intermediate_size"],
                 num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"],
                 num_key_value_heads=m["n_kv_heads"], vocab_size=m["vocab_size"],
                 rope_theta=m["rope_theta"], rope_scaling=m.get("rope_scaling"),
                 rms_norm_eps=m["norm_eps"],
                 max_position_embeddings=m.get("max_position_embeddings") or a.context + a.gen,
                 tie_word_embeddings=False, attn_implementation="sdpa", torch_dtype=torch.bfloat16,
                 **extra)
    with torch.device("meta"):
        model = Model(cfg)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.eval()
    ids = torch.randint(0, m["vocab_size"], (1, a.context), device="cuda")
    from transformers import StaticCache

    cache = StaticCache(config=cfg, max_cache_len=a.context + a.gen + 1)
    times = []
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                    cache_position=torch.arange(a.context, device="cuda"))
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        for i in range(a.gen):
            t = time.perf_counter()
            out = model(nxt, past_key_values=cache, use_cache=True,
                        cache_position=torch.tensor([a.context + i], device="cuda"))
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    times = times[2:]  # the first calls warm up SDPA / cuBLAS
    ms = sorted(times)[len(times) // 2] * 1e3
    res = {"peer": f"transformers {Model.__name__} eager (sdpa, StaticCache)", "model": a.model,
           "context": a.context, "gen": a.gen, "prefill_s": prefill_s, "ms_per_token_p50": ms,
           "decode_tokens_per_s": len(times) / sum(times), "device": torch.cuda.get_device_name(),
           "transformers": __import__("transformers").__version__}
    print(json.dumps(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
