"""Per-kernel summary of an Nsight Compute source-page export: where the warps stalled and what
loaded / stored shared memory, by SASS opcode (a development tool; the numbers of
bench/results/fp8-decode-k-layout-h100.txt came from it).

    ncu ... -o prof -f python bench/ncu_decode.py          # needs SourceCounters (see there)
    ncu -i prof.ncu-rep --page source --print-source sass --csv > prof-sass.csv
    python bench/ncu_summary.py prof-sass.csv [--top 12]
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
COUNTS = ("Instructions Executed", "L1 Wavefronts Shared", "L1 Wavefronts Shared Excessive",
          SAMPLES)


def kernels(text: str) -> list[tuple[str, list[dict[str, str]]]]:
    """(kernel name, rows) for each kernel of the export: a '"Kernel Name",NAME' line, then a
    header line and one row per SASS instruction."""
    out = []
    for part in text.split('"Kernel Name"')[1:]:
        lines = part.splitlines()
        name = next(csv.reader([lines[0]]))[1] if lines[0].strip(",") else "?"
        out.append((name, list(csv.DictReader(lines[1:]))))
    return out


def number(row: dict[str, str], key: str) -> float:
    return float((row.get(key) or "0").replace(",", "") or 0)


def summarize(name: str, rows: list[dict[str, str]], top: int) -> str:
    samples = sum(number(r, SAMPLES) for r in rows) or 1.0
    stalls = Counter({k: sum(number(r, k) for r in rows) for k in rows[0]
                      if k.startswith("stall_") and "Not Issued" not in k})
    by_op: dict[str, list[float]] = {}
    for r in rows:
        source = re.sub(r"^@!?U?P\w+\s+", "", r.get("Source", "").strip()).split()
        op = source[0] if source else "?"
        acc = by_op.setdefault(op, [0.0] * len(COUNTS))
        for i, key in enumerate(COUNTS):
            acc[i] += number(r, key)
    lines = [f"{name}: {len(rows)} instructions, {samples:.0f} stall samples",
             "  stalls (% of samples): " + ", ".join(
                 f"{k.removeprefix('stall_')} {100 * v / samples:.1f}"
                 for k, v in stalls.most_common(8)),
             "  shared wavefronts {:.2f} M ({:.2f} M excessive)".format(
                 sum(v[1] for v in by_op.values()) / 1e6, sum(v[2] for v in by_op.values()) / 1e6),
             f"  {'opcode':26s} {'executed':>11s} {'wavefronts':>11s} {'excessive':>10s} "
             f"{'% samples':>9s}"]
    # The opcodes that stall most, then those that move the most shared memory.
    ranked = sorted(by_op.items(), key=lambda kv: -kv[1][3])[:top]
    ranked += [kv for kv in sorted(by_op.items(), key=lambda kv: -kv[1][1])[:top]
               if kv[1][1] and kv not in ranked]
    for op, (n, wf, ex, smp) in ranked:
        lines.append(f"  {op:26s} {n:11.0f} {wf:11.0f} {ex:10.0f} {100 * smp / samples:9.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", type=Path, help="`ncu -i R --page source --print-source sass --csv`")
    ap.add_argument("--top", type=int, default=12, help="opcodes to list per kernel")
    args = ap.parse_args()
    found = kernels(args.csv.read_text())
    if not found:
        ap.error(f"{args.csv}: no '\"Kernel Name\"' line (not a source-page export?)")
    for i, (name, rows) in enumerate(found):
        print(f"[{i}] " + summarize(name, rows, args.top))


if __name__ == "__main__":
    main()
