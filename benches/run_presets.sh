#!/usr/bin/env bash
# Runs every `pagedrs bench` preset on the default model and writes the records and plots to
# docs/bench/ (what docs/benchmarks.md explains). About 20 minutes on a 2-core machine.
# The load generator runs on the same machine as the server: its CPU time is part of what
# is measured (see docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/bench}
PAGEDRS=${PAGEDRS:-.venv/bin/pagedrs}
PORT=${PORT:-8311}
mkdir -p "$OUT"

# Cold start: process start to the first token (the bench launches its own server).
$PAGEDRS bench serve --preset cold-start --launch --output "$OUT/cold-start.json" --no-progress

# Memory pressure: a 48 MiB KV cache (its own server), 24 concurrent 256+256-token requests.
$PAGEDRS bench serve --preset memory-pressure --launch --output "$OUT/memory-pressure.json" --no-progress

# The rest share one server with the default settings.
$PAGEDRS serve --port "$PORT" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
URL="http://127.0.0.1:$PORT"

$PAGEDRS bench sweep --preset no-reuse --base-url "$URL" --num-requests 16 --concurrency 1,4,16,32 \
    --out-dir "$OUT" --no-progress
$PAGEDRS bench sweep --preset shared-prefix --base-url "$URL" --num-requests 16 --concurrency 1,8 \
    --out-dir "$OUT" --no-progress
# Continuous batching against HF static batches of 8 on the same requests. The HF side runs
# in the bench process after the server run, while the server sits idle.
$PAGEDRS bench serve --preset mixed-lengths --base-url "$URL" --hf-baseline --output "$OUT/mixed-lengths.json" \
    --no-progress
$PAGEDRS bench plot "$OUT"/memory-pressure.json --out-dir "$OUT"
kill $SERVER; wait $SERVER 2>/dev/null || true

# The memory model against a server with a 64 MiB cache under the same load.
$PAGEDRS serve --port "$PORT" --kv-cache-memory 64MiB > "$OUT/server-64mib.log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
$PAGEDRS memory --budget 64MiB --lengths 300,600,900,1200 --check "$URL" --json > "$OUT/memory-check.json"
$PAGEDRS memory --budget 64MiB --lengths 300,600,900,1200 --check "$URL"
