"""A projection kernel's launch config tried in the model, without changing the code: runs
launch/decode.py with kernels/gemv.py's `gemv` (batch 1) and/or `skinny_gemm` (batch 2-16)
taking fixed configs for the weight shapes named, in place of their rules.

Chains of one kernel (bench/gemv.py) and the model can rank configs differently: the skinny
GEMM's 256-wide tiles read tp=2's qkv at 66% of the bandwidth against 76% in a chain, yet made
the model 1.5% faster (BENCHMARKS.md, "The skinny GEMM"). So a rule is settled here, with the
variants alternated in one call on one machine. (Each config is its own binary of the same
kernel, so this compares like with like; a change to the code itself is bench/ab.sh's job.)

    torchrun --nproc_per_node=2 bench/model_rules.py --gemv 5120x8192=4,512,2 -- \
        +model=codellama34b parallel.tp=2 context_len=16384 gen_len=64 prefill=synthetic
    torchrun --nproc_per_node=2 bench/model_rules.py --skinny 64,256,4,4 5120x8192=64,128,4,4 -- \
        +model=codellama34b parallel.tp=2 context_len=32768 batch=8 gen_len=64 prefill=synthetic

--gemv entries are [NxK=]BLOCK_N,BLOCK_K,WARPS and --skinny entries
[NxK=]BLOCK_N,BLOCK_K,WARPS,STAGES, keyed by the weight's shape [N, K] (a gated GEMV's N counts
gate and up rows); an entry without a key applies to every shape not named, and shapes left out
keep the rule. Everything after `--` goes to launch/decode.py. Rank 0 adds the overrides to the
run's summary.json ("rule_overrides").
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each kind: the function of kernels/gemv.py it wraps and its config's length. Every caller
# imports these from the module at call time, so replacing the module's attribute reaches them.
KINDS = {"gemv": ("gemv", 3), "skinny": ("skinny_gemm", 4)}


def parse_entries(entries: list[str], length: int, flag: str
                  ) -> dict[tuple[int, int] | None, tuple[int, ...]]:
    """{(N, K) or None: config} from '[NxK=]A,B,...' entries of `length` integers."""
    table: dict[tuple[int, int] | None, tuple[int, ...]] = {}
    for e in entries:
        key, _, cfg = e.rpartition("=")
        try:
            vals = tuple(int(v) for v in cfg.split(","))
            shape = tuple(int(v) for v in key.split("x")) if key else None
        except ValueError:
            vals, shape = (), None
        if len(vals) != length or (key and (shape is None or len(shape) != 2)):
            raise SystemExit(f"{flag}: '{e}' is not [NxK=] followed by {length} integers")
        table[shape] = vals
    return table


def apply_overrides(tables: dict[str, dict[tuple[int, int] | None, tuple[int, ...]]]) -> None:
    """Replace kernels/gemv.py's `gemv` / `skinny_gemm` by wrappers that pass the tables'
    config for the weight's shape where the caller gave none."""
    from longctx.kernels import gemv as mod

    for kind, table in tables.items():
        if not table:
            continue
        fn = getattr(mod, KINDS[kind][0])
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapped(*args, _fn=fn, _sig=sig, _table=table, **kwargs):
            bound = _sig.bind(*args, **kwargs)
            if bound.arguments.get("config") is None:
                shape = tuple(bound.arguments["weight"].shape)
                bound.arguments["config"] = _table.get(shape, _table.get(None))
            return _fn(*bound.args, **bound.kwargs)

        setattr(mod, KINDS[kind][0], wrapped)


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(this script's options, launch/decode.py's arguments), split at the first "--". Without
    one and without options (the rule's own arm) every argument is decode.py's: torchrun drops a
    "--" that comes right after the script."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    if not any(a.startswith(("--gemv", "--skinny")) for a in argv):
        return [], argv
    raise SystemExit("usage: bench/model_rules.py [--gemv ...] [--skinny ...] -- DECODE_ARGS...")


def main() -> None:
    opts, rest = split_argv(sys.argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gemv", nargs="*", default=[], help="[NxK=]BLOCK_N,BLOCK_K,WARPS")
    p.add_argument("--skinny", nargs="*", default=[], help="[NxK=]BLOCK_N,BLOCK_K,WARPS,STAGES")
    a = p.parse_args(opts)
    tables = {kind: parse_entries(getattr(a, kind), KINDS[kind][1], f"--{kind}")
              for kind in KINDS}
    apply_overrides(tables)
    record = {kind: {"x".join(map(str, k)) if k else "*": list(v) for k, v in t.items()}
              for kind, t in tables.items() if t}
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
