#!/usr/bin/env bash
# One GPU session: install longctx over the machine's torch, run the test suite (kernels compiled
# for the GPU, gpu-marked tests included; TESTS overrides the pytest arguments), then the
# benchmark cases given as arguments (each a quoted launch/bench.py argument list).
#   bash bench/gpu_check.sh "case=decode tag=h100" "case=prefill tag=h100"
# Results go to $OUT (or bench/results when OUT is unset). Hydra may come as wheels in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
out=${OUT:-bench/results}
status=0
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q ${TESTS:-tests/} 2>&1 | tail -25 | tee "$out/gpu-tests.log" || status=1
fi
for args in "$@"; do
  # shellcheck disable=SC2086
  python3 launch/bench.py $args output_dir="$out" 2>&1 | tee -a "$out/bench.log" || status=1
done
exit $status
