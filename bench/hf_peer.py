"""The transformers peer for launch/decode.py: Hugging Face LlamaForCausalLM `generate` (SDPA
attention, static cache) on the same random-weight architecture, one GPU, greedy.

    python bench/hf_peer.py --model codellama34b --context 16384 --gen 64

Decode tokens/s = (gen - 1) / (time(generate gen tokens) - time(generate 1 token)): the
difference removes the prefill. Prints one line and writes it as JSON with --out.
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
    from transformers import LlamaConfig, LlamaForCausalLM

    m = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs/model" / f"{a.model}.yaml").read_text())
    m = m.get("model", m)
    cfg = LlamaConfig(hidden_size=m["dim"], intermediate_size=m["intermediate_size"],
                      num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"],
                      num_key_value_heads=m["n_kv_heads"], head_dim=m["head_dim"],
                      vocab_size=m["vocab_size"], rope_theta=m["rope_theta"],
                      rms_norm_eps=m["norm_eps"], max_position_embeddings=a.context + a.gen,
                      tie_word_embeddings=False, attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.eval()
    ids = torch.randint(0, m["vocab_size"], (1, a.context), device="cuda")

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       cache_implementation="static", pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    gen(2)  # warm-up
    t1, tn = gen(1), gen(a.gen)
    res = {"peer": "transformers generate (sdpa, static cache)", "model": a.model,
           "context": a.context, "gen": a.gen, "prefill_s": t1,
           "decode_tokens_per_s": (a.gen - 1) / (tn - t1), "device": torch.cuda.get_device_name()}
    print(json.dumps(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
