# The two promises of the README: `make test` and `make demo` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test durations demo docs docs-gen bench bench-check gpu-check protos clean

TORCH := 2.13.0
CPU_INDEX := https://download.pytorch.org/whl/cpu
# torch is pinned first: a plain `torch` requirement would pull PyPI's CUDA build (gigabytes more).
# With an NVIDIA GPU (nvidia-smi answers) that build; without, the CPU one: from the indexes pip
# already knows where one holds it (a mirror, --find-links), else from PyTorch's CPU index.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if nvidia-smi >/dev/null 2>&1; then \
		echo "torch $(TORCH): the CUDA build (an NVIDIA GPU answers)"; $(BIN)/pip install -q torch==$(TORCH); \
	else \
		echo "torch $(TORCH): the CPU build (no NVIDIA GPU)"; \
		$(BIN)/pip install -q torch==$(TORCH)+cpu 2>/dev/null \
			|| $(BIN)/pip install -q torch==$(TORCH) --index-url $(CPU_INDEX); \
	fi
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

venv: $(STAMP)

# Every test's seconds are kept in build/tests.xml (JUnit); `make durations` sums them up into
# tests/durations.json and the design page's table of the ten slowest (commit both).
# The package's bytecode first: where PYTHONDONTWRITEBYTECODE is set (as on the development machine) every
# coordinator, agent and CLI call the suite starts (~1,000) compiled its modules again (0.2 s of CPU each).
test: $(STAMP)
	$(BIN)/python -m compileall -q src
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=15 --junitxml=build/tests.xml

durations: $(STAMP)
	mkdir -p build
	$(BIN)/python tests/durations.py build/tests.xml > build/durations.json
	mv build/durations.json tests/durations.json
	$(BIN)/python docs/generate.py

demo: $(STAMP)
	$(BIN)/muster --log-level warning demo --duration 45

# The site in docs/ (mkdocs.yml); --strict: a warning (a broken link or anchor) fails the build.
# docs/generate.py writes the CLI and wire pages and the tables generated from the code and
# bench/results/ into the committed pages (docs-gen); `docs` fails while one is stale.
docs: $(STAMP)
	$(BIN)/python docs/generate.py --check
	$(BIN)/mkdocs build --strict --site-dir site

docs-gen: $(STAMP)
	$(BIN)/python docs/generate.py

# Minutes, on an otherwise idle machine: the numbers are timings.
bench: $(STAMP)
	mkdir -p bench/results
	$(BIN)/python bench/side_by_side.py --ranks 4,8,16 --kills 5 --unmodified-ranks 4,8 --nodes 2 > bench/results/side_by_side.json
	$(BIN)/python bench/recovery.py --ranks 8 --model tiny --kills 5 --hangs 3 --failovers 3 > bench/results/recovery.json
	$(BIN)/python bench/recovery.py --ranks 4 --model tiny,17M,50M,100M --kills 5 --hangs 1 --failovers 0 > bench/results/recovery_sizes.json
	$(BIN)/python bench/death_heard.py --model tiny,17M,50M,100M --kills 5 > bench/results/death_heard.json
	$(BIN)/python bench/capacity.py > bench/results/capacity.json
	$(BIN)/python bench/capacity.py --nodes 1000 --rate 10,15,20 --skip-membership > bench/results/capacity_direct_rates.json
	$(BIN)/python bench/capacity.py --relays 2 --rate 3,10 --nodes 1000 --skip-membership > bench/results/capacity_relays.json
	$(BIN)/python bench/capacity.py --relays 0 --rate 3,10 --nodes 1000 --skip-membership > bench/results/capacity_direct.json
	$(BIN)/python bench/capacity.py --relays 2 --rate 3 --nodes 250,1000,2000 --skip-membership > bench/results/capacity_relays_summaries.json
	$(BIN)/python bench/capacity.py --relays 2 --rate 0.25 --heartbeat-timeout 20 --nodes 12500 --window 16 --skip-membership > bench/results/capacity_relays_12500.json
	$(BIN)/python bench/grpc_floor.py --streams 1000 --rate 10 > bench/results/grpc_floor.json
	$(BIN)/python bench/grpc_floor.py --streams 1000 --rate 10 --loop asyncio > bench/results/grpc_floor_asyncio.json
	$(BIN)/python bench/scale.py > bench/results/scale.json
	$(BIN)/python bench/scale.py --relayed > bench/results/scale_relayed.json
	$(BIN)/python bench/scale.py --relayed --ranks 1000000 > bench/results/scale_1m_relayed.json
	$(BIN)/python bench/hsdp.py > bench/results/hsdp.json
	$(BIN)/python bench/snapshots.py > bench/results/snapshots.json
	$(BIN)/python bench/rank_start.py > bench/results/rank_start.json
	$(BIN)/python bench/churn.py > bench/results/churn.json
	$(BIN)/python bench/churn.py --retain-finished 15s > bench/results/churn_retention.json

# Before a change to the coordinator's core or wire path (1.5-2 minutes): the leader's hot path (a
# membership change at 100k ranks, 1,000 nodes x 10 frames/s, ...) against bench/results/bench_check.json;
# exit 1 when a figure is worse than it by more than its tolerance, 2 when too noisy to tell; a latency
# past its absolute bound (frame p50 5 ms, p99 10 ms) is worse whatever the noise (bench/check.py says
# what noise each figure tolerates).
# BENCH_CHECK_ARGS=--update writes that baseline (after a deliberate change, on a quiet machine).
bench-check: $(STAMP)
	$(BIN)/python bench/check.py $(BENCH_CHECK_ARGS)

# On a machine with CUDA: tests/gpu and the NCCL recovery benchmark (bench/results/nccl.json), a
# one-screen summary against the targets. Without CUDA it says so and passes (GPU_CHECK_ARGS=--require-gpu
# fails instead). A GPU machine without a registry: bench/gpu_check.sh.
gpu-check: $(STAMP)
	$(BIN)/python bench/gpu_check.py $(GPU_CHECK_ARGS)

protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I protos --python_out=src --grpc_python_out=src \
		--pyi_out=src protos/muster/v1/muster.proto

clean:
	rm -rf $(VENV) .muster site
