#!/usr/bin/env bash
# The fp8 KV cache on one H200 (CodeLlama-34B's 67.5 GB of weights and a 262144-token bf16 cache
# need its 141 GB; on an H100 steps 1-2 run and step 3 stops at the memory check), ~6 minutes:
# correctness first, then the numbers.
#   bash bench/fp8_check.sh            # from the repository root; PYTHON=... to pick the interpreter
# 1. pytest: the fp8 tests on the GPU (store kernels bit for bit, decode and prefill kernels within
#    2x of plain PyTorch's error, the API's fast launch and CUDA-graph replay), and the fast-launch
#    and decode tests whose launch arguments the fp8 path extended.
# 2. launch/bench.py decode_table=fp8 on a subset of its rows: longctx fp8 vs longctx bf16 vs vLLM's
#    fp8 Triton kernel (.peers/vllm_triton_decode_attention.py; bash bench/fetch_vllm_peer.sh).
# 3. CodeLlama-34B (random weights), one GPU: bf16 vs fp8 cache, synthetic 262144-token cache
#    (decode tokens/s), and fp8 with a real chunked prefill of 16384 tokens (the prefill kernel
#    reading the fp8 history).
# Prints a summary table last; everything goes to outputs/fp8_check/.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
OUT=outputs/fp8_check
mkdir -p "$OUT"
status=0
step() { echo; echo "=== $1"; }

step "1/3 tests (GPU)"
timeout 240 "$PY" -m pytest -q -x tests/test_fp8_kv.py tests/test_fast_launch_gpu.py \
    tests/test_decode.py 2>&1 | tail -15 || status=1

step "2/3 decode kernel: fp8 vs bf16 longctx vs vLLM fp8"
timeout 200 "$PY" launch/bench.py case=decode decode_table=fp8 output_dir="$OUT" tag=check \
    rep_ms=50 'decode.shapes=[[64,1024],[8,8192],[1,65536],[1,262144]]' \
    'decode.extra_heads=[[64,8,[[8,8192],[1,262144]]],[32,4,[[8,8192],[1,262144]]]]' \
    2>&1 | tail -20 || status=1

step "3/3 CodeLlama-34B decode, one GPU"
for run in "bf16 auto synthetic 262144 32" "fp8 fp8_e4m3 synthetic 262144 32" \
           "fp8 fp8_e4m3 real 16384 16"; do
    set -- $run
    timeout 150 "$PY" launch/decode.py +model=codellama34b kv_cache_dtype="$2" prefill="$3" \
        context_len="$4" gen_len="$5" output="$OUT/$1-$3" 2>&1 | tail -8 || status=1
done

step "summary"
"$PY" - "$OUT" <<'PY'
import glob, json, sys
out = sys.argv[1]
try:
    rows = json.load(open(f"{out}/decode-check.json"))["rows"]
except OSError:
    rows = []
def best(r, n):
    ts = [t for t in (r.get(f"{n}_us"), r.get(f"{n}_graph_us")) if t]
    return min(ts) if ts else None
print("decode kernel (µs, best of eager / CUDA graph):")
print(f"{'heads':>6} {'B':>4} {'N':>7} {'fp8':>7} {'%floor':>6} {'bf16':>7} {'bf16/fp8':>8} {'vllm fp8':>8} {'vllm/ours':>9} {'err':>8}")
for r in rows:
    t, b, v = best(r, "longctx"), best(r, "longctx_bf16"), best(r, "vllm_fp8")
    fmt = lambda x, w, f=".1f": f"{x:>{w}{f}}" if x else f"{'n/a':>{w}}"
    print(f"{r['q_heads']:>3}/{r['kv_heads']:<2} {r['batch']:>4} {r['seq_len']:>7} {fmt(t, 7)} "
          f"{100 * r['floor_us'] / t:>5.0f}% {fmt(b, 7)} {fmt(b and b / t, 7, '.2f')}x "
          f"{fmt(v, 8)} {fmt(v and v / t, 8, '.2f')}x {r['longctx_max_err']:>8.1e}")
    if r.get("vllm_fp8_note"):
        print(f"        vllm_fp8: {r['vllm_fp8_note']}")
print("\nCodeLlama-34B, one GPU:")
for path in sorted(glob.glob(f"{out}/*/*/summary.json")):
    s = json.load(open(path))
    print(f"{path.split('/')[-3]:>20}: KV {s['kv_cache_dtype']}, context {s['prompt_len']}, "
          f"decode {s['decode_tokens_per_s']:.1f} tok/s, {s['pct_of_bandwidth_limit']:.1f}% of the "
          f"limit, largest context {s['largest_context_len']:,}"
          + (f", prefill {s['prefill_tokens_per_s']:.0f} tok/s" if s.get("prefill_tokens_per_s") else ""))
PY
exit $status
