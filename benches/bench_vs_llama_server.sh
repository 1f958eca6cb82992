#!/bin/bash
# mixed-lengths over HTTP: llama.cpp's llama-server, then `pagedrs serve`, on the default GGUF.
# Each server is started fresh and measured four times (greedy, temperature 1.0, greedy,
# temperature 1.0); records go to docs/bench/mixed-lengths-{llama-server,pagedrs-q4}-t*-run*.json,
# numbered by RUNS (default "1 2"; RUNS="3 4" for a second round); TAG (e.g. "-avx2") goes after
# the server's name in each file name, so runs of another build keep their own records.
# Run on an idle machine from the checkout root. LLAMA_SERVER names the binary, built from the
# sources vendored in the llama-cpp-python sdist:
#   cmake -B build -G Ninja -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target llama-server
set -euo pipefail
LLAMA_SERVER=${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary}
GGUF=$(.venv/bin/python -c "from pagedrs.models.loader import default_model_path; print(default_model_path())")

RUNS=${RUNS:-1 2}
TAG=${TAG:-}

measure() {  # label port
  for run in $RUNS; do
    for t in 0 1.0; do
      .venv/bin/pagedrs bench serve --preset mixed-lengths --base-url "http://127.0.0.1:$2" --temperature "$t" \
        --label "$1" --output "docs/bench/mixed-lengths-$1$TAG-t$t-run$run.json" --no-progress
    done
  done
}

wait_healthy() { until curl -sf "http://127.0.0.1:$1/health" >/dev/null; do sleep 1; done; }

"$LLAMA_SERVER" -m "$GGUF" -t 2 -tb 2 -c 32768 -np 64 --port 8790 >/tmp/llama-server.log 2>&1 &
server=$!
wait_healthy 8790
measure llama-server 8790
kill "$server"; wait "$server" || true

.venv/bin/pagedrs serve --port 8791 >/tmp/pagedrs-serve.log 2>&1 &
server=$!
wait_healthy 8791
measure pagedrs-q4 8791
kill "$server"; wait "$server" || true
