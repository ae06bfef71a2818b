"""bench/results/ holds exactly what BENCHMARKS.md cites: every cited path exists, and every
recorded file is cited (the untracked bench/results/raw/ of GPU sessions is not a record).

A citation is a path `bench/results/...` in backquotes, possibly with `*` or `{a,b}`, e.g.
`bench/results/model/decode_g2_{tp2,sp2}_*.json`; README.md's citations must exist too."""

from __future__ import annotations

import fnmatch
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
UNRECORDED = ("raw/",)  # GPU-session output, git-ignored


def expand_braces(pattern: str) -> list[str]:
    """'a{b,c}d{e,f}' -> ['abde', 'abdf', 'acde', 'acdf'] (no nesting)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def cited_patterns(doc: Path) -> list[str]:
    """The bench/results/ paths cited in `doc`, relative to bench/results/, braces expanded."""
    text = doc.read_text()
    paths = re.findall(r"`(bench/results/[^`\s]+)`", text)
    rel = (p.removeprefix("bench/results/") for path in paths for p in expand_braces(path))
    return [p for p in rel if not p.startswith(UNRECORDED)]


def recorded_files() -> list[str]:
    files = (p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file())
    return sorted(f for f in files if not f.startswith(UNRECORDED))


def test_expand_braces() -> None:
    assert expand_braces("x_{a,b}_*.json") == ["x_a_*.json", "x_b_*.json"]
    assert expand_braces("plain.txt") == ["plain.txt"]


def test_every_cited_result_exists() -> None:
    files = recorded_files()
    for doc in (ROOT / "BENCHMARKS.md", ROOT / "README.md"):
        for pattern in cited_patterns(doc):
            assert fnmatch.filter(files, pattern), f"{doc.name} cites bench/results/{pattern}: no such file"


def test_every_result_is_cited() -> None:
    patterns = cited_patterns(ROOT / "BENCHMARKS.md")
    assert patterns, "BENCHMARKS.md cites no bench/results/ file"
    uncited = [f for f in recorded_files() if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert not uncited, f"bench/results/ files that BENCHMARKS.md does not cite: {uncited}"
