"""bench/triton_bundle.sh `use`: the ptxas a GPU run compiles with are the ones carried in that
call, even where an earlier `use` on the same machine unpacked another set into the same site
(a run meant to time the legacy ptxas must not silently time ptxas-blackwell). A fake bundle
stands in for Triton's: a package that imports, its two ptxas as files of their own."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PATH": "/usr/bin:/bin"}  # the shell's ptxas: one of these or /usr/local/cuda*'s
pytestmark = pytest.mark.skipif(shutil.which("xz") is None, reason="needs xz")


def _xz(data: bytes, dest: Path) -> None:
    dest.write_bytes(subprocess.run(["xz", "-c"], input=data, capture_output=True,
                                    check=True).stdout)


def _bundle(tmp: Path, version: str) -> Path:
    """DIR with triton-VERSION-{rest.tar,lib,ptxas,ptxas-blackwell}.xz as `make` writes them."""
    pkg = tmp / "pkg" / "triton"
    (pkg / "_C").mkdir(parents=True)
    (pkg / "backends" / "nvidia" / "bin").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (pkg / "knobs.py").write_text('ptxas_blackwell = "ptxas-blackwell"\n')
    d = tmp / "bundle"
    d.mkdir()
    with tarfile.open(tmp / "rest.tar", "w") as t:
        t.add(pkg, arcname="triton")
    _xz((tmp / "rest.tar").read_bytes(), d / f"triton-{version}-rest.tar.xz")
    _xz(b"not a library", d / f"triton-{version}-lib.xz")
    for tool in ("ptxas", "ptxas-blackwell"):
        _xz(f"#!/bin/sh\necho {tool}\n".encode(), d / f"triton-{version}-{tool}.xz")
    return d


def _use(bundle: Path, env_before: str = "") -> dict[str, str]:
    """The ptxas knobs and unpacked tools after `source bench/triton_bundle.sh use DIR`."""
    script = (f"{env_before} source bench/triton_bundle.sh use {bundle} >/dev/null || exit 1\n"
              'echo "path=${TRITON_PTXAS_PATH-unset}"\n'
              'echo "blackwell=${TRITON_PTXAS_BLACKWELL_PATH-unset}"\n'
              'echo "tools=$(cd $TRITON_BUNDLE_SITE/triton/backends/nvidia/bin && ls | xargs)"\n')
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                       env=ENV)
    assert r.returncode == 0, r.stderr
    return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)


def test_use_takes_the_ptxas_carried_this_time(tmp_path):
    version = f"0.0.{uuid.uuid4().hex[:8]}"
    bundle = _bundle(tmp_path, version)
    site = Path(f"/tmp/triton-{version}")
    legacy = site / "triton" / "backends" / "nvidia" / "bin" / "ptxas"
    stash = tmp_path / "stash"
    stash.mkdir()

    def carry(*tools: str) -> None:  # the ptxas files in the bundle this time, the rest aside
        for t in ("ptxas", "ptxas-blackwell"):
            name = f"triton-{version}-{t}.xz"
            src = bundle / name if (bundle / name).exists() else stash / name
            shutil.move(src, (bundle if t in tools else stash) / name)

    try:
        # both carried: Triton's own choice, whatever the shell had exported
        got = _use(bundle, env_before="export TRITON_PTXAS_BLACKWELL_PATH=/elsewhere;")
        assert got == {"path": "unset", "blackwell": "unset", "tools": "ptxas ptxas-blackwell"}
        # only ptxas-blackwell: the older targets take the machine's CUDA ptxas ("" if none)
        machine = subprocess.run(
            ["bash", "-c", "command -v ptxas || ls /usr/local/cuda*/bin/ptxas | head -n 1"],
            capture_output=True, text=True, env=ENV).stdout.strip()
        carry("ptxas-blackwell")
        got = _use(bundle)
        assert got == {"path": machine, "blackwell": "unset", "tools": "ptxas-blackwell"}
        # then only the legacy ptxas, into the same site: sm_90 compiles with it
        carry("ptxas")
        got = _use(bundle)
        assert got == {"path": "unset", "blackwell": str(legacy), "tools": "ptxas"}
        # neither: both knobs point at the machine's
        carry()
        assert _use(bundle) == {"path": machine, "blackwell": machine, "tools": ""}
    finally:
        shutil.rmtree(site, ignore_errors=True)
