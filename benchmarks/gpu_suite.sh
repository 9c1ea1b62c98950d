#!/usr/bin/env bash
# The GPU run behind the headline tables: kernel tests, bench, speculation per workload, greedy checks,
# serving, slow tests; every step's JSON goes to $OUT. The GPU machine has no venv: it expects the
# dependency wheels in .whl/ and the catalog models under $SPECSERVE_CACHE (../shared/models.md says how
# to stage them), and the checkout on PYTHONPATH stands for the installed package.
# SERVER_EXTRA: more `specserve serve` flags for serve and fidelity (e.g. --batch-invariant).
# `smoke` runs first whenever the GPU machine is used (benchmarks/README.md): the GPU tests, one client on a small and
# a large pool, 64 clients and greedy fidelity, as one table.
# Usage: [FORMAT=gguf] [OUT=dir] [SERVE_MODES=none,ngram-simple] [ROUNDS=3] [CATEGORY=code_edit] [MIXES=long] bash
#   benchmarks/gpu_suite.sh [smoke kernels bench spec graphs serve fidelity remote remoteserve moe moellama slowtests
#   paged pool mixes kvtypes batchprofile edits treestep]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"
FORMAT="${FORMAT:-float}"  # weight format of bench, spec and serve (float or gguf)
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
# the workloads: ../shared's where the checkout has it, else the copy carried in .whl/
shared_prompts="$PWD/../shared/workloads/prompts.json"
[ -f "$shared_prompts" ] || shared_prompts="$PWD/.whl/prompts.json"
export SPECSERVE_WORKLOADS="${SPECSERVE_WORKLOADS:-$shared_prompts}"
T=${MODEL:-qwen2.5-coder-1.5b}  # the target model (MODEL: another catalog name or a file, e.g. for a dry run on a CPU)
D=qwen2.5-coder-0.5b
sfx=$([ "$FORMAT" = float ] && echo "" || echo "_$FORMAT")  # the results' file names, as in benchmarks/results/
steps="${*:-kernels bench spec graphs serve}"
for step in $steps; do
    echo "=== $step ($(date +%T))"
    case "$step" in
        smoke) timeout 595 python3 benchmarks/gpu_smoke.py -m $T --weight-format "${FORMAT}" --prompts "$SPECSERVE_WORKLOADS" \
                   -o "$OUT/gpu_smoke_$FORMAT.json" 2>&1 | grep -v "^---" | tail -12 ;;
        kernels) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -3 ;;
        bench) timeout 600 python3 -m specserve.cli bench -m $T --weight-format "$FORMAT" ${BENCH_ARGS:--md $D} \
                   -o "$OUT/bench_${T}_cuda$sfx.json" 2>&1 | grep -v "load:" | tail -22 ;;
        spec) timeout 900 python3 benchmarks/spec_bench.py -m $T -md $D -n 256 --weight-format "$FORMAT" \
                  -o "$OUT/spec_${T}_cuda$sfx.json" 2>&1 | tail -22 ;;
        graphs) timeout 300 python3 benchmarks/graph_check.py -m $T -n 128 -o "$OUT/graph_check_$T.json" 2>&1 | tail -10 ;;
        serve) timeout 900 python3 benchmarks/serve_bench.py -m $T --device cuda --clients "${CLIENTS:-1,4,16,64}" \
                   --requests ${REQUESTS:-2} --rounds ${ROUNDS:-1} -n 128 --modes "${SERVE_MODES:-none,ngram-suffix}" --prompts "$SPECSERVE_WORKLOADS" \
                   ${CATEGORY:+--category "$CATEGORY"} -o "$OUT/serve_${T}_cuda$sfx${CATEGORY:+_$CATEGORY}.json" \
                   --server-args --weight-format "$FORMAT" ${SERVER_EXTRA:-} 2>&1 | tail -20 ;;
        fidelity) timeout 600 python3 benchmarks/fidelity_check.py -m $T --device cuda -n 128 --prompts "$SPECSERVE_WORKLOADS" \
                      -o "$OUT/fidelity_${T}_cuda$sfx${SERVER_EXTRA:+_invariant}.json" \
                      --server-args --weight-format "$FORMAT" ${SERVER_EXTRA:-} 2>&1 | tail -14 ;;
        remote) timeout 600 python3 benchmarks/remote_bench.py -m $T --device cuda --weight-format "$FORMAT" \
                    --transports "${TRANSPORTS:-unix,tcp}" \
                    -o "$OUT/remote_${T}_cuda$sfx.json" 2>&1 | tail -8 ;;
        remoteserve) # serving through a remote host on this machine against the same server run locally
            timeout 300 python3 -m specserve.cli remote-host --listen unix:/tmp/specserve-host.sock &
            host=$!; sleep 5
            timeout 400 python3 benchmarks/serve_bench.py -m $T --device cuda --clients "${CLIENTS:-64}" \
                --requests ${REQUESTS:-2} -n 128 --modes none --prompts "$SPECSERVE_WORKLOADS" \
                -o "$OUT/serve_${T}_remote$sfx.json" --server-args --weight-format "$FORMAT" \
                --remote unix:/tmp/specserve-host.sock 2>&1 | tail -4
            kill $host ;;
        moe) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_moe_experts.py tests/test_moe_models.py \
                 tests/test_moe_routing.py 2>&1 | tail -3
             timeout 400 python3 benchmarks/moe_bench.py --sections experts,decode --weight-format "${MOE_FORMAT:-q8}" \
                 -o "$OUT/moe_bench_cuda_decode.json" 2>&1 | tail -18 ;;
        moellama) # LLAMA_BIN: llama.cpp's CUDA build (llama-bench, llama-quantize and their libraries)
            timeout 1500 python3 benchmarks/moe_llama_cpp.py --llama-bin "$LLAMA_BIN" --types "${MOE_TYPES:-Q8_0,Q4_K_M}" \
                -o "$OUT/moe_llama_cpp.json" 2>&1 | tail -8 ;;
        slowtests) timeout 900 python3 -m pytest -q -p no:cacheprovider -m slow 2>&1 | tail -5 ;;
        batchprofile) # a serving step's kernels at 64 and 256 decode rows (random weights: no model file needed)
            timeout 120 python3 benchmarks/attention_bench.py --contexts 600,2048 --rows 1,64,256,512 \
                --grid-programs 1048576,2048 -o "$OUT/attention_bench.json" 2>&1 | tail -20
            timeout 300 python3 benchmarks/batch_profile.py --rows 64,256 --chunks 0,448 --formats gguf_like,float \
                --grid-programs 1048576,2048 -o "$OUT/batch_profile.json" 2>&1 | tail -90 ;;
        paged) # the paged KV pool on the GPU: kernels, graphs against eager, the pool's scheduling
            timeout 500 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_graph_buckets.py \
                tests/test_cuda_builds.py tests/test_kv_blocks.py tests/test_kv_pool.py tests/test_batch_invariant.py \
                2>&1 | tail -3
            timeout 300 python3 benchmarks/attention_bench.py -o "$OUT/attention_bench.json" 2>&1 | tail -14 ;;
        pool) # one client on a pool sized for many (-np 64 -c 1048576): plain and ngram-suffix code edits, and tg128
            timeout 300 python3 -m specserve.cli bench -m $T --weight-format "$FORMAT" --spec-types none --no-hf -n 128 \
                -o "$OUT/bench_tg_${T}_cuda$sfx.json" 2>&1 | grep -E "^ *(pp|tg)" ;
            timeout 400 python3 benchmarks/serve_bench.py -m $T --device cuda --clients 1 --slot-ctx 1048576 --requests 3 \
                -n 128 --modes none,ngram-suffix --category code_edit --prompts "$SPECSERVE_WORKLOADS" \
                -o "$OUT/serve_${T}_cuda${sfx}_pool.json" --server-args --weight-format "$FORMAT" -np 64 2>&1 | tail -4 ;;
        mixes) # issue 25's mixes: long prompts (ITL while they are read), shared and per-tenant system prompts
            for mix in ${MIXES:-long shared-system tenants}; do
                timeout 600 python3 benchmarks/serve_bench.py -m $T --device cuda --clients "${CLIENTS:-16,64}" \
                    --requests ${REQUESTS:-2} -n 128 --modes none --mix "$mix" --prompts "$SPECSERVE_WORKLOADS" \
                    -o "$OUT/serve_${T}_cuda${sfx}_$mix.json" --server-args --weight-format "$FORMAT" \
                    ${SERVER_EXTRA:-} 2>&1 | tail -5
            done ;;
        kvtypes) # -ctk/-ctv against the compute dtype through specserve serve: greedy text and pool size per type, then
                 # 1 and 64 clients with and without q8_0 keys and values, alternating twice
            timeout 300 python3 benchmarks/kv_types_check.py -m $T --device cuda --slots 64 --types default,q8_0,q4_0 \
                -n 128 --prompts "$SPECSERVE_WORKLOADS" -o "$OUT/kv_types_${T}_cuda$sfx.json" \
                --server-args --weight-format "$FORMAT" 2>&1 | tail -8
            for round in 1 2; do
                for kv in default q8_0; do
                    flags=$([ $kv = default ] || echo "-ctk $kv -ctv $kv")
                    timeout 200 python3 benchmarks/serve_bench.py -m $T --device cuda --clients 1,64 --requests 2 -n 128 \
                        --modes none --prompts "$SPECSERVE_WORKLOADS" -o "$OUT/serve_${T}_cuda${sfx}_kv_${kv}_$round.json" \
                        --server-args --weight-format "$FORMAT" $flags 2>&1 | tail -3 | sed "s/^/$kv round $round: /"
                done
            done ;;
        edits) # issue 42's table: whole-file edits (predictions, suffix matches, token trees) and the agent loop
               # through specserve serve, at each of EDIT_CLIENTS (1: one request at a time; more: that many in flight
               # on a server of as many slots, each mode in turn so that a mode meets only its own load)
            for n in ${EDIT_CLIENTS:-1}; do
                port=$((8097 + n))
                # --draft-tree: the tree graphs are captured at start (modes without a tree part send tree_nodes 0)
                python3 -m specserve.cli serve -m $T --weight-format "$FORMAT" -np $n -c $((n > 1 ? n * 16384 : 32768)) --port $port \
                    --draft-tree 16 > "$OUT/edits_server_$n.log" 2>&1 &
                server=$!
                for _ in $(seq 150); do curl -sf http://127.0.0.1:$port/health > /dev/null && break; sleep 1; done
                timeout 900 python3 benchmarks/edit_bench.py --url http://127.0.0.1:$port --concurrency $n --save-texts \
                    $([ $n -gt 1 ] && echo "--modes-in-turn --limit 24 --max-tokens 256" || echo "--limit 8 --max-tokens 512") \
                    --modes "${EDIT_MODES:-none,prediction,prediction+ngram-suffix,prediction+ngram-suffix+tree16,ngram-suffix,ngram-suffix+tree16}" \
                    --agent-modes "${AGENT_MODES:-none,ngram-suffix,ngram-suffix+tree16}" \
                    -o "$OUT/edit_${T}_cuda${sfx}_$n.json" 2>&1 | grep -Ev "^  (edits|agent) [^ ]+ \([0-9]+ tokens\)" | tail -30
                kill $server; wait $server
            done ;;
        treestep) # a token tree's verify step against a chain's, from graphs and eager (random weights)
            (cd benchmarks && timeout 300 python3 tree_step_bench.py -o "$OUT/tree_step.json" 2>&1 | tail -10) ;;
        *) echo "unknown step: $step (smoke kernels bench spec graphs serve fidelity remote remoteserve moe moellama slowtests paged pool mixes kvtypes batchprofile edits treestep)" ;;
    esac
done
