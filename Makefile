# Two entry points that work on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/python -m pip
STAMP   := $(VENV)/.installed
TSTAMP  := $(VENV)/.installed-test

.PHONY: demo test test-fast lint venv clean architecture

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools

# constraints.txt pins torch==2.13.0 (CPU wheel) so no CUDA build is ever pulled.
$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(PIP) install -q -c constraints.txt -e .
	touch $@

# Test extras, then the collaborative-training stack: MindSpore (needs protobuf>=7.34.1) and Flower
# (declares protobuf<7 but runs on 7.36.2), so flwr goes in with --no-deps and its other
# requirements from requirements-flwr.txt.
$(TSTAMP): $(STAMP) requirements-flwr.txt
	$(PIP) install -q -c constraints.txt -e '.[test]'
	$(PIP) install -q -c constraints.txt mindspore==2.10.0
	$(PIP) install -q --no-deps flwr==1.42.0
	@# pip then lists flwr's declared pins as conflicts in red; they are overridden on purpose
	$(PIP) install -q -c constraints.txt -r requirements-flwr.txt 2>$(VENV)/pip-flwr.log; s=$$?; \
	  grep -v -e "dependency resolver does not currently" -e "^flwr 1.42.0 requires" $(VENV)/pip-flwr.log >&2; \
	  echo "note: flwr 1.42.0 runs on protobuf 7, rich 15 and typer 0.29 although it declares older pins"; exit $$s
	$(PIP) install -q -c constraints.txt scikit-learn
	$(PIP) install -q -c constraints.txt -e '.[prune]'
	@# Paddle and TensorFlow centers (18 s on the build machine; 195 MB + 274 MB of wheels, 2 GB installed)
	$(PIP) install -q -c constraints.txt -e '.[paddle,tensorflow]'
	touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/polyparallel graph gpt-tiny --summary
	mkdir -p .demo
	$(BIN)/polyparallel search gpt-tiny --cluster local-cpu:2 --batch-size 16 --out .demo/strategy.json
	$(BIN)/polyparallel explain .demo/strategy.json
	rm -rf .demo/run
	$(BIN)/polyparallel train .demo/strategy.json --model gpt-tiny --steps 5 --run-dir .demo/run
	$(BIN)/polyparallel search gpt2-small --cluster dgx-a100x1 --batch-size 64 --out .demo/gpt2-small.json

# The suite runs on min(cores, 4) pytest-xdist workers (TEST_WORKERS=0: all in this process); the
# tests that start Flower federations run one after another on one of them (tests/conftest.py).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

# Two tiers, both run by `make test` (and CI): the default tier (-m "not slow": units, search,
# pricing, single trainings), then the slow tier (federations over Flower, multi-process trainings of
# HF models, published-run pricing, the docs' examples). `make test-fast` runs the default tier alone.
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15

test: $(TSTAMP)
	$(BIN)/ruff check .
	$(PYTEST) -m "not slow"
	$(PYTEST) -m slow

test-fast: $(TSTAMP)
	$(BIN)/ruff check .
	$(PYTEST) -m "not slow"

lint: $(TSTAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# docs/architecture.md is generated from the import graph, docs/cluster-spec.md from the spec's
# models (tests/test_architecture.py and tests/test_cluster_spec_docs.py check they are current)
architecture: $(STAMP)
	$(BIN)/python docs/architecture.py
	$(BIN)/python docs/cluster_spec.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
