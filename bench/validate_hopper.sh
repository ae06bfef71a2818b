#!/usr/bin/env bash
# GPU validation of the Gluon Hopper prefill path (kernels/prefill_hopper.py) on one H100 or
# H200. From the repository root, after `source bench/device_env.sh`:
#   LONGCTX_COMMIT=<commit> bash bench/validate_hopper.sh STEP...      (default: check tests bench)
# Steps, each well under 10 minutes on an H100 (run them as separate GPU calls if need be):
#   check  bench/check_prefill_hopper.py: correctness of every case the kernel covers (odd
#          lengths, offsets, varlen, head_dim 64/256, the fused merge) against the fp32
#          reference, then a short timing table against cuDNN and the Triton kernel (~4 min);
#   tests  the GPU tests of the prefill kernels and the ring (tests/test_prefill_hopper.py
#          against the float64 reference at 1 .. 65537 rows, tests/test_prefill.py,
#          tests/test_ring_gpu.py) (~4 min, most of it compiling);
#   bench  launch/bench.py's issue-22 prefill table (bf16, 4000 / 12000 / 33000 / 65537 rows x
#          16/2, 24/8, 32/32 heads, causal or not, head_dim 64 / 256 at 16384, varlen) with SDPA
#          flash (FA2) and cuDNN as peers and the Triton kernel beside it (~5 min; tag
#          $GPU_TAG, default h100);
#   short  bench/prefill_short.py: the dispatch thresholds re-measured (~3 min);
#   old    the session-9 table (4096 / 16384 / 65536 rows, 16/2 and 32/32), as dispatched.
# Logs, JSON and plots go to $OUT (default the untracked bench/results/raw). Exit status 1 if any step failed; every
# step runs regardless. LONGCTX_COMMIT names the commit in the JSON when the tree has no .git.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results/raw}
tag=${GPU_TAG:-h100}
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
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(check tests bench)
for step in "${steps[@]}"; do
  case $step in
    check) run check-prefill-hopper-$tag "$py" bench/check_prefill_hopper.py ;;
    tests) run validate-hopper-tests-$tag "$py" -m pytest -q -m gpu \
             tests/test_prefill_hopper.py tests/test_prefill.py tests/test_ring_gpu.py ;;
    bench) run prefill-issue22-$tag "$py" launch/bench.py case=prefill prefill_table=issue22 \
             tag="issue22-$tag" output_dir="$out" ;;
    short) run prefill-short-$tag "$py" bench/prefill_short.py ;;
    old)   run prefill-old-$tag "$py" launch/bench.py case=prefill tag="$tag" \
             "prefill.peers=[sdpa_flash,sdpa_cudnn]" output_dir="$out" ;;
    *) echo "unknown step $step (check | tests | bench | short | old)"; status=1 ;;
  esac
done
echo "total $SECONDS s; results in $out"
exit $status
