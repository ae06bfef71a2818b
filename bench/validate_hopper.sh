#!/usr/bin/env bash
# GPU validation of the Gluon Hopper prefill path (kernels/prefill_hopper.py) on one H100, in
# well under 10 minutes. From the repository root, after `source bench/device_env.sh`:
#   LONGCTX_COMMIT=<commit> bash bench/validate_hopper.sh
# 1. the GPU tests of the prefill kernels and the ring: the Gluon kernel against the fp32
#    reference, its fused merge against the Triton kernel's, the dispatch, the ring's plan and
#    determinism on it, and every Triton launch config (tests/test_prefill.py);
# 2. launch/bench.py's prefill case (bf16, D=128, 16/2 and 32/32 heads, 4096-65536 rows, causal
#    or not) with SDPA flash and cuDNN as peers, twice: as dispatched (tag h100-hopper) and with
#    LONGCTX_PREFILL_KERNEL=triton (tag h100-triton); ~1 minute each on an H100.
# Logs, JSON and plots go to $OUT (default bench/results). Exit status 1 if any step failed; every
# step runs regardless. LONGCTX_COMMIT names the commit in the JSON when the tree has no .git.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results}
mkdir -p "$out"
py=${PYTHON:-python3}
status=0

run() {  # run LOG CMD...: CMD's output on the console and in $out/LOG.log, with its time
  local log=$out/$1.log t0=$SECONDS
  shift
  echo "+ $*" | tee "$log"
  "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
  [ "$rc" = 0 ] || status=1
}

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
run validate-hopper-tests "$py" -m pytest -q -m gpu \
  tests/test_prefill_hopper.py tests/test_prefill.py tests/test_ring_gpu.py
run validate-hopper-bench "$py" launch/bench.py case=prefill tag=h100-hopper \
  "prefill.peers=[sdpa_flash,sdpa_cudnn]" output_dir="$out"
run validate-triton-bench env LONGCTX_PREFILL_KERNEL=triton "$py" launch/bench.py case=prefill \
  tag=h100-triton "prefill.peers=[sdpa_flash,sdpa_cudnn]" output_dir="$out"
echo "total $SECONDS s; results in $out"
exit $status
