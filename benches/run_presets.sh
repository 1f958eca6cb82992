#!/usr/bin/env bash
# Runs the `pagedrs bench` presets on the default model and writes the records and plots to
# docs/bench/ (what docs/benchmarks.md explains). All steps take about 25 minutes on a 2-core
# machine; name steps to run only those:
#   benches/run_presets.sh [cold-start] [memory-pressure] [no-reuse] [shared-prefix] [mixed-lengths] [memory-check]
# The load generator runs on the same machine as the server, and the records say how much CPU
# each side used. Keep the machine otherwise idle while this runs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/bench}
PAGEDRS=${PAGEDRS:-.venv/bin/pagedrs}
PORT=${PORT:-8311}
URL="http://127.0.0.1:$PORT"
STEPS=${*:-cold-start memory-pressure no-reuse shared-prefix mixed-lengths memory-check}
mkdir -p "$OUT"
SERVER=

start_server() {  # start_server LOG [pagedrs serve flags...]
    local log=$1; shift
    $PAGEDRS serve --port "$PORT" "$@" > "$log" 2>&1 &
    SERVER=$!
    for _ in $(seq 300); do curl -sf "$URL/health" > /dev/null && return; sleep 1; done
    echo "the server did not start; see $log" >&2; exit 1
}
stop_server() { if [ -n "$SERVER" ]; then kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; SERVER=; fi; }
trap stop_server EXIT

for step in $STEPS; do
    case $step in
    cold-start)  # process start to the first token (the bench launches its own server)
        $PAGEDRS bench serve --preset cold-start --launch --output "$OUT/cold-start.json" --no-progress ;;
    memory-pressure)  # a 48 MiB KV cache (its own server), 24 concurrent 256+256-token requests
        $PAGEDRS bench serve --preset memory-pressure --launch --output "$OUT/memory-pressure.json" --no-progress
        $PAGEDRS bench plot "$OUT/memory-pressure.json" --out-dir "$OUT" ;;
    no-reuse)
        start_server "$OUT/server.log"
        $PAGEDRS bench sweep --preset no-reuse --base-url "$URL" --num-requests 16 --concurrency 1,4,16,32 \
            --out-dir "$OUT" --no-progress
        stop_server ;;
    shared-prefix)
        start_server "$OUT/server.log"
        $PAGEDRS bench sweep --preset shared-prefix --base-url "$URL" --num-requests 16 --concurrency 1,8 \
            --out-dir "$OUT" --no-progress
        stop_server ;;
    mixed-lengths)  # against HF static batches of 8, run in the bench process while the server idles
        start_server "$OUT/server.log"
        $PAGEDRS bench serve --preset mixed-lengths --base-url "$URL" --hf-baseline \
            --output "$OUT/mixed-lengths.json" --no-progress
        stop_server ;;
    memory-check)  # the memory model against a server with a 64 MiB cache under the same load
        start_server "$OUT/server-64mib.log" --kv-cache-memory 64MiB
        $PAGEDRS memory --budget 64MiB --lengths 100,250,400,600 --check "$URL" --json > "$OUT/memory-check.json"
        $PAGEDRS memory --budget 64MiB --lengths 100,250,400,600 --check "$URL"
        stop_server ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
