"""bench/results/ holds exactly what BENCHMARKS.md cites: every cited path exists, and every
recorded file is cited (the untracked bench/results/raw/ of GPU runs is not a record).

A citation is a path `bench/results/...` in backquotes, possibly with `*` or `{a,b}`, e.g.
`bench/results/model/decode_g2_{tp2,sp2}_*.json`; README.md's citations must exist too."""

from __future__ import annotations

import fnmatch
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
UNRECORDED = ("raw/",)  # GPU runs' output, git-ignored


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


def _section(text: str, anchor: str) -> str:
    """The text of the BENCHMARKS.md section whose GitHub anchor is `anchor`, up to the next
    heading."""
    heads = list(re.finditer(r"^#+ (.+)$", text, re.M))
    for i, h in enumerate(heads):
        slug = re.sub(r"[^\w\- ]", "", h.group(1).lower()).replace(" ", "-")
        if slug == anchor:
            end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
            return text[h.start():end]
    raise AssertionError(f"README.md links to BENCHMARKS.md#{anchor}: no such section")


def test_readme_rows_agree_with_benchmarks() -> None:
    """Each row of README's "Where it stands" links to its BENCHMARKS.md section, and every number
    of the row (sizes, results, peers, commit) and its GPU are in that section: a re-measured
    section leaves no stale row behind."""
    readme = (ROOT / "README.md").read_text()
    bench = (ROOT / "BENCHMARKS.md").read_text()
    table = readme.split("## Where it stands", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in table.splitlines() if r.startswith("| [")]
    assert len(rows) >= 8, rows
    for row in rows:
        anchor = re.search(r"\(BENCHMARKS\.md#([\w-]+)\)", row).group(1)
        section = _section(bench, anchor).replace(",", "")
        cells = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", row).replace(",", "")
        section_words = set(re.findall(r"[0-9a-f]{7}|\d+(?:\.\d+)?", section))
        for word in re.findall(r"\b[0-9a-f]{7}\b|\d+(?:\.\d+)?", cells):
            assert word in section_words, f"README row {row!r}: {word} is not in section #{anchor}"
        for gpu in re.findall(r"H100|H200", row):
            assert gpu.lower() in section.lower(), f"README row {row!r}: {gpu} not in #{anchor}"
