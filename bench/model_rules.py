"""A projection kernel's launch rule tried in the model, without changing the code: runs
launch/decode.py with kernels/gemv.py's `gemv_config` (batch 1) and/or `skinny_config` (batch
2-16) answering fixed configs for the shapes named.

Chains of one kernel (bench/gemv.py) and the model can rank configs differently: the skinny
GEMM's 256-wide tiles read tp=2's qkv at 66% of the bandwidth against 76% in a chain, yet made
the model 1.5% faster (BENCHMARKS.md, "The skinny GEMM"). So a rule is settled here, with the
variants alternated in one call on one machine. (Each config is its own binary of the same
kernel, so this compares like with like; a change to the code itself is bench/ab.sh's job.)

    torchrun --nproc_per_node=2 bench/model_rules.py --gemv 8192=4,1024,4 -- \\
        +model=codellama34b parallel.tp=2 context_len=16384 gen_len=64 prefill=synthetic
    torchrun --nproc_per_node=2 bench/model_rules.py --skinny 64,256,4,4 5120=64,128,4,4 -- \\
        +model=codellama34b parallel.tp=2 context_len=32768 batch=8 gen_len=64 prefill=synthetic

--gemv entries are [K=]BLOCK_N,BLOCK_K,WARPS, keyed by the weight's in-features K; --skinny
entries [N=]BLOCK_N,BLOCK_K,WARPS,STAGES, keyed by its out-features N. An entry without a key
applies to every shape not named; shapes left out keep the rule. Everything after `--` goes to
launch/decode.py. Rank 0 adds the overrides to the run's summary.json ("rule_overrides").
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (config length, key of the rule's arguments): gemv_config(K), skinny_config(N, K).
RULES = {"gemv": ("gemv_config", 3, lambda K: K), "skinny": ("skinny_config", 4, lambda N, K: N)}


def parse_entries(entries: list[str], length: int, flag: str) -> dict[int | None, tuple]:
    """{key or None: config} from '[KEY=]A,B,...' entries of `length` integers."""
    table: dict[int | None, tuple] = {}
    for e in entries:
        key, _, cfg = e.rpartition("=")
        try:
            vals = tuple(int(v) for v in cfg.split(","))
            k = int(key) if key else None
        except ValueError:
            vals, k = (), None
        if len(vals) != length:
            raise SystemExit(f"{flag}: '{e}' is not [KEY=] followed by {length} integers")
        table[k] = vals
    return table


def apply_overrides(tables: dict[str, dict[int | None, tuple]]) -> None:
    """Replace kernels/gemv.py's rules by ones that answer the tables' configs (the module's
    own functions look the rules up by name at each call)."""
    from longctx.kernels import gemv as mod

    for kind, table in tables.items():
        if not table:
            continue
        name, _, key_of = RULES[kind]
        rule = getattr(mod, name)

        def patched(*shape, _rule=rule, _table=table, _key=key_of):
            return _table.get(_key(*shape), _table.get(None)) or _rule(*shape)

        setattr(mod, name, patched)


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit("usage: bench/model_rules.py [--gemv ...] [--skinny ...] -- DECODE_ARGS...")
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gemv", nargs="*", default=[], help="[K=]BLOCK_N,BLOCK_K,WARPS")
    p.add_argument("--skinny", nargs="*", default=[], help="[N=]BLOCK_N,BLOCK_K,WARPS,STAGES")
    a = p.parse_args(argv[:cut])
    tables = {kind: parse_entries(getattr(a, kind), RULES[kind][1], f"--{kind}")
              for kind in RULES}
    apply_overrides(tables)
    record = {kind: {str(k) if k is not None else "*": list(v) for k, v in t.items()}
              for kind, t in tables.items() if t}
    rest = argv[cut + 1:]
    output = Path(next((x.split("=", 1)[1] for x in rest if x.startswith("output=")),
                       "outputs/decode"))
    if os.environ.get("RANK", "0") == "0":
        print(f"rule overrides: {record or 'none'}", flush=True)
    start = time.time()
    script = ROOT / "launch" / "decode.py"
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")
    if os.environ.get("RANK", "0") == "0":
        for summary in output.glob("*/summary.json"):
            if summary.stat().st_mtime >= start:
                s = json.loads(summary.read_text())
                s["rule_overrides"] = record
                summary.write_text(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()
