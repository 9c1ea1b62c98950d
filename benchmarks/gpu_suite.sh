#!/usr/bin/env bash
# The GPU run behind the closing notes: kernels, bench, speculation, serving, greedy checks.
# Expects the catalog models joined under $SPECSERVE_CACHE and wheels in .whl/ (see
# ../shared/models.md for staging). Usage: bash benchmarks/gpu_suite.sh [steps...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
export SPECSERVE_WORKLOADS="${SPECSERVE_WORKLOADS:-$PWD/../shared/workloads/prompts.json}"
T=qwen2.5-coder-1.5b
D=qwen2.5-coder-0.5b
steps="${*:-kernels bench spec graphs serve}"
for step in $steps; do
    echo "=== $step ($(date +%T))"
    case "$step" in
        kernels) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -3 ;;
        bench) timeout 600 python3 -m specserve.cli bench -m $T ${BENCH_ARGS:--md $D} 2>&1 | grep -v "load:" | tail -22 ;;
        spec) timeout 900 python3 benchmarks/spec_bench.py -m $T -md $D -n 256 2>&1 | tail -22 ;;
        graphs) timeout 300 python3 benchmarks/graph_check.py -m $T -n 128 2>&1 | tail -10 ;;
        serve) timeout 900 python3 benchmarks/serve_bench.py -m $T --device cuda --clients 1,4,16,64 \
                   --requests 2 -n 128 --modes none,ngram-simple --prompts "$SPECSERVE_WORKLOADS" 2>&1 | tail -14 ;;
        slowtests) timeout 900 python3 -m pytest -q -p no:cacheprovider -m slow 2>&1 | tail -5 ;;
    esac
    cp benchmarks/results/*qwen*.json "$OUT/" 2>/dev/null
done
