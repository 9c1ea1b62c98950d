#!/usr/bin/env bash
# Where `specserve serve`'s host time goes at many clients, on the GPU machine: one server (-np NP -c CTX) under
# serve_bench at each of CLIENTS, with the step trace (SPECSERVE_STEP_TRACE, read it with step_trace.py), py-spy's
# GIL samples of the engine core and of the front (py-spy carried as a wheel in .whl/, as gpu_suite.sh installs
# them) and each process's CPU share; everything in one archive, $OUT/serve_profile_$TAG.tgz.
# Usage: [M=model] [NP=256] [CTX=131072] [CLIENTS="64 256"] [TAG=a] [EXTRA="more serve flags"] OUT=dir \
#   bash benchmarks/serve_profile.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
work=$(mktemp -d); TAG=${TAG:-a}; PORT=${PORT:-8181}; SPY=${SPY:-/tmp/site/bin/py-spy}
prompts=${SPECSERVE_WORKLOADS:-$PWD/../shared/workloads/prompts.json}
[ -f "$prompts" ] || prompts=$PWD/.whl/prompts.json
SPECSERVE_STEP_TRACE=$work/trace_$TAG.json python3 -m specserve.cli serve -m "${M:-qwen2.5-coder-1.5b}" \
    --weight-format gguf -np "${NP:-256}" -c "${CTX:-131072}" --port "$PORT" ${EXTRA:-} > "$work/serve_$TAG.log" 2>&1 &
front=$!
for _ in $(seq 150); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 2; done
core=$(pgrep -P "$front" -f spawn_main | head -1)
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
for n in ${CLIENTS:-64 256}; do
    requests=$([ "$n" -le 64 ] && echo 6 || echo 2)
    "$SPY" record --gil -r 200 -d 6 -p "$core" -f raw -o "$work/spy_core${n}_$TAG.txt" > /dev/null 2>&1 &
    spy_core=$!
    "$SPY" record --gil -r 200 -d 6 -p "$front" -f raw -o "$work/spy_front${n}_$TAG.txt" > /dev/null 2>&1 &
    spy_front=$!
    a=$(cpu "$front"); b=$(cpu "$core"); t=$(date +%s.%N)
    python3 benchmarks/serve_bench.py --url "http://127.0.0.1:$PORT" --clients "$n" --requests "$requests" -n 128 \
        --modes none --prompts "$prompts" -o "$work/serve_${n}_$TAG.json" 2>&1 | tail -2
    t2=$(date +%s.%N)
    python3 -c "print('CPU share: front %.0f%%, core %.0f%%' % (($(cpu "$front") - $a) / ($t2 - $t), ($(cpu "$core") - $b) / ($t2 - $t)))"
    wait "$spy_core" "$spy_front"
done
kill -TERM "$front"; timeout 60 tail --pid="$front" -f /dev/null
tar czf "${OUT:-/tmp/out}/serve_profile_$TAG.tgz" -C "$work" .
