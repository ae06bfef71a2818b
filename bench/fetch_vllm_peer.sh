#!/usr/bin/env bash
# The vLLM peer of the fp8-KV decode table (launch/bench.py case=decode decode_table=fp8): vLLM's
# Triton decode-attention kernel file, taken from the vllm wheel (kernel file only, not vLLM),
# into .peers/vllm_triton_decode_attention.py (ignored by git). Run where pip reaches PyPI,
# then carry .peers/ to the GPU machine:
#   bash bench/fetch_vllm_peer.sh [vllm version]
# Without the file the bench prints a note and skips the peer.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_31_x86_64 --dest "$tmp" "vllm${version:+==$version}" >&2
wheel="$(ls "$tmp"/vllm-*.whl)"
# Where the file lives moved across releases: take the first of the known places.
member="$(python3 - "$wheel" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
for p in ("vllm/v1/attention/ops/triton_decode_attention.py",
          "vllm/attention/ops/triton_decode_attention.py"):
    if p in names:
        print(p)
        break
else:
    sys.exit("no triton_decode_attention.py in " + sys.argv[1] + ": " +
             ", ".join(sorted(n for n in names if "decode_attention" in n)))
PY
)"
mkdir -p .peers
python3 - "$wheel" "$member" <<'PY'
import sys, zipfile
wheel, member = sys.argv[1:]
src = zipfile.ZipFile(wheel).read(member).decode()
header = f"# {member} from {wheel.rsplit('/', 1)[-1]} (Apache-2.0), unmodified below this line\n"
open(".peers/vllm_triton_decode_attention.py", "w").write(header + src)
PY
echo "wrote .peers/vllm_triton_decode_attention.py ($member of $(basename "$wheel"))"
