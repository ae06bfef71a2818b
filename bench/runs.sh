#!/usr/bin/env bash
# The GPU measurements of BENCHMARKS.md, one subcommand each, on one host (run from the repository
# root of a GPU machine; Hydra may come as wheels in .whl/, see bench/device_env.sh):
#   bash bench/runs.sh check "case=decode tag=h100" "case=prefill tag=h100"
#                                           # the test suite on this GPU, both processes at once (TESTS
#                                           # overrides pytest's arguments, SKIP_TESTS=1 skips
#                                           # it, TEST_WORKERS: default 8), then launch/bench.py
#                                           # once per quoted argument list: the kernel tables
#   bash bench/runs.sh decode 16384 65536   # CodeLlama-34B decode: tp=G and sp=G (G=1: one run each)
#   LAYOUTS="parallel.tp=2,parallel.sp=2" bash bench/runs.sh decode 16384   # other tp x sp splits
#   bash bench/runs.sh hf 16384 65536       # the transformers peer on one GPU at these contexts
#   bash bench/runs.sh ring                 # ring prefill vs one GPU and torch context parallel
#   bash bench/runs.sh ring4                # the same at 131072 and 524288 tokens (4 GPUs)
#   bash bench/runs.sh allreduce            # NCCL vs symmetric-memory all-reduce latency
# G = NGPU (default: all visible GPUs). Output (JSON, plots, runs.log) goes to $OUT, default the
# untracked bench/results/raw/; copy what a BENCHMARKS.md table cites into bench/results/.
# Exit status 1 if any step failed; every step runs regardless.
set -uo pipefail
usage="check <bench args>... | decode <contexts> | hf <contexts> | ring | ring4 | allreduce"
case ${1:-} in check|decode|hf|ring|ring4|allreduce) ;; *) echo "usage: bash bench/runs.sh $usage"; exit 2 ;; esac
cd "$(dirname "$0")/.."
source bench/device_env.sh || exit 1
out=${OUT:-bench/results/raw}
mkdir -p "$out"
G=${NGPU:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
what=$1
shift
status=0
run() {  # run CMD...: CMD's output (warnings dropped) on the console and in $out/runs.log
  echo "+ $*" | tee -a "$out/runs.log"
  "$@" 2>&1 | grep -v -i "warn" | tee -a "$out/runs.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
prefill() {  # prefill S KV_HEADS ARGS...: ring prefill, 32 query heads, head_dim 128, bf16, causal
  local S=$1 kv=$2; shift 2
  run torchrun --nproc_per_node="$G" launch/prefill.py seq_len="$S" q_heads=32 kv_heads="$kv" \
    head_dim=128 dtype=bfloat16 causal=true "$@"
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$out/runs.log"
case $what in
  check)
    if [ -z "${SKIP_TESTS:-}" ]; then
      # Both processes of make test (8 workers each; the slowest tests listed), at the same time:
      # the interpreter process needs no GPU, and on a GPU host's 16-32 cores the two finish in
      # about the time of the main one (2x H200: 218 s and 97 s together, against ~320 s in turn).
      # shellcheck disable=SC2086
      for p in main interp; do
        ( [ $p = interp ] && export TRITON_INTERPRET=1
          if [ $p = main ]; then durations=--durations=20; else durations=; fi
          python3 -m pytest -q -n "${TEST_WORKERS:-8}" $durations ${TESTS:-tests/} \
            > "$out/tests-$p.log" 2>&1
          echo $? > "$out/tests-$p.rc" ) &
      done
      wait
      for p in main interp; do
        echo "+ pytest ($p process): $out/tests-$p.log" | tee -a "$out/runs.log"
        tail -n 30 "$out/tests-$p.log" | tee -a "$out/runs.log"
        [ "$(cat "$out/tests-$p.rc")" = 0 ] || status=1
      done
    fi
    for args in "$@"; do
      # shellcheck disable=SC2086
      run python3 launch/bench.py $args output_dir="$out"
    done
    ;;
  ring)
    for S in 32768 131072; do
      prefill $S 32 warmup=2 iters=5 compare_max_len=131072 "peers=[cp_cudnn,cp_flash]"
    done
    prefill 32768 8 warmup=2 iters=5 "peers=[cp_cudnn]"
    ;;
  ring4)
    for S in 131072 524288; do
      prefill $S 32 warmup=1 iters=3 compare_max_len=524288 "peers=[cp_cudnn]"
    done
    ;;
  allreduce)
    run torchrun --nproc_per_node="$G" bench/allreduce.py --out "$out/allreduce_g$G.json"
    ;;
  decode)
    layouts=("parallel.tp=$G" "parallel.sp=$G")
    [ "$G" = 1 ] && layouts=("parallel.tp=1")
    [ -n "${LAYOUTS:-}" ] && read -r -a layouts <<< "$LAYOUTS"  # e.g. "parallel.tp=2,parallel.sp=2"
    for C in "$@"; do
      for par in "${layouts[@]}"; do
        tag="decode_g${G}_$(echo "$par" | sed 's/parallel\.//g' | tr -d '=,')_$C"
        run torchrun --nproc_per_node="$G" launch/decode.py +model=codellama34b ${par//,/ } \
          context_len="$C" gen_len=64 profile="${PROFILE:-false}" output="$out/runs/$tag"
        cp "$(ls -d "$out/runs/$tag"/*/ | tail -1)summary.json" "$out/$tag.json" || status=1
      done
    done
    ;;
  hf)
    for C in "$@"; do
      run python3 bench/hf_peer.py --context "$C" --gen 24 --out "$out/hf_peer_$C.json"
    done
    ;;
esac
exit $status
