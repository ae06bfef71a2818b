#!/usr/bin/env bash
# A/B of launch/decode.py between an older revision's code and this tree's, on one machine: the
# two arms alternate ROUNDS times (each run installs its tree's longctx, editable), then a table
# gives each run's decode tokens/s and % of the limit, each arm's mean, the change, and the read
# bandwidth the runs measured.
#   bash bench/ab.sh REV [ROUNDS] -- DECODE_ARGS...
#   NGPU=2 bash bench/ab.sh 517f6b8 2 -- +model=codellama34b parallel.tp=2 context_len=16384 \
#       gen_len=64 prefill=synthetic
# REV: a commit of this checkout (its .git must hold it) or a directory with an older tree (e.g.
# made here with `git archive REV | tar -x -C scratch/old` and carried to a GPU machine).
# Compare against the old code itself, not a switch inside the new code: a switch compiles the new
# code into the old arm too. a947530's GEMV shares gained 0.3-0.9% against such an arm and lost
# 6-9% against the tree before them (BENCHMARKS.md, "Tried and dropped").
# G = NGPU (default 1) processes under torchrun. Output: $OUT (default bench/results/raw/ab): each
# run's directory under runs/, a copy of its summary.json as summary-ARM-ROUND.json (a device
# run's $OUT brings back files near its top only), the table in ab.txt. Exit status 1 if a run
# failed.
set -uo pipefail
usage="bash bench/ab.sh REV [ROUNDS] -- DECODE_ARGS..."
[ $# -ge 2 ] || { echo "usage: $usage"; exit 2; }
rev=$1
shift
rounds=2
if [ "$1" != "--" ]; then rounds=$1; shift; fi
[ "${1:-}" = "--" ] || { echo "usage: $usage"; exit 2; }
shift
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a positive integer, got '$rounds'"; exit 2; }
old=
if [ -d "$rev" ]; then old=$(cd "$rev" && pwd); fi  # (a path from the caller's directory)
cd "$(dirname "$0")/.."
root=$PWD
source bench/device_env.sh || exit 1
out=${OUT:-bench/results/raw/ab}
rm -rf "$out/runs" "$out"/summary-*.json  # the table reads this call's summaries only
mkdir -p "$out/runs"
out=$(cd "$out" && pwd)
if [ -z "$old" ]; then
  old=$(mktemp -d)
  trap 'rm -rf "$old"' EXIT
  git archive "$rev" | tar -x -C "$old" || { echo "bench/ab.sh: no revision '$rev' here"; exit 2; }
fi
status=0
install() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1) ; }
for r in $(seq "$rounds"); do
  for arm in old new; do
    tree=$old; [ $arm = new ] && tree=$root
    install "$tree" || { echo "bench/ab.sh: installing $tree failed"; status=1; continue; }
    dir="$out/runs/$arm-$r"
    echo "+ round $r, $arm ($tree)"
    (cd "$tree" && torchrun --nproc_per_node="${NGPU:-1}" launch/decode.py "$@" output="$dir") \
      2>&1 | grep -i "tokens/s\|limit \|error\|Traceback" | grep -v -i "warn"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    cp "$dir"/*/summary.json "$out/summary-$arm-$r.json" 2>/dev/null
  done
done
install "$root"  # leave this tree's longctx installed
python3 - "$out" "$rev" <<'EOF' | tee "$out/ab.txt"
import glob, json, os, statistics, sys

out, rev = sys.argv[1:]
runs = {"old": [], "new": []}
for path in sorted(glob.glob(os.path.join(out, "summary-*.json"))):
    arm = os.path.basename(path).split("-")[1]
    runs[arm].append(json.load(open(path)))
# Each run's tokens/s and its % of the bandwidth limit (the model's bytes at the read bandwidth
# that run measured): a table that outlives the run's summaries says which machine it was.
print(f"{'arm':<24} {'decode tokens/s (% of the limit), each run':<48} mean")
mean = {arm: statistics.mean(s["decode_tokens_per_s"] for s in runs[arm]) if runs[arm]
        else float("nan") for arm in runs}
for arm, name in (("old", rev), ("new", "this tree")):
    each = ", ".join(f"{s['decode_tokens_per_s']:.1f} ({s['pct_of_bandwidth_limit']:.1f}%)"
                     for s in runs[arm])
    print(f"{name:<24} {each:<48} {mean[arm]:.1f}")
if runs["old"] and runs["new"]:
    print(f"change: {100 * (mean['new'] / mean['old'] - 1):+.1f}%")
bw = [s["read_bandwidth_Bps_per_device"] / 1e12 for a in ("old", "new") for s in runs[a]]
if bw:
    print(f"read bandwidth per GPU, as measured in the runs: {min(bw):.2f}-{max(bw):.2f} TB/s "
          f"({runs['new'][0]['device'] if runs['new'] else runs['old'][0]['device']})")
EOF
exit $status
