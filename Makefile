# Two commands for a fresh machine: `make demo` and `make test`. Both create or reuse .venv and
# fetch the Kafka jars into ~/.cache/rlstream once; pip's cache serves torch on later installs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rlstream-installed

.PHONY: test test-unit lint demo bench jars clean-venv

$(STAMP): pyproject.toml setup.py schemas/_rowcopy.c
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --progress-bar off -e '.[dev]'
	@touch $@

jars: $(STAMP)
	$(BIN)/rlstream broker fetch

test: jars
	$(BIN)/python -m pytest -q -rs

# Pure code only: no broker, no Ray.
test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -rs tests/unit

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

demo: jars
	$(BIN)/rlstream demo

bench: jars
	$(BIN)/python bench/bench_schemas.py
	$(BIN)/python bench/bench_pipeline.py
	$(BIN)/python bench/bench_restore.py
	$(BIN)/python bench/bench_dataplane.py
	$(BIN)/python bench/bench_scaling.py
	$(BIN)/python bench/bench_failover.py

# The chaos drill, outside `make test`: 2,000 groups (10% lost to the admission gate) through a pool of
# SIGKILLed reassemblers (every crash point, random instants taken over by the spare), a zombie, a
# worker frozen mid-step, a frozen transaction coordinator, a broker kill -9 and a trainer kill; exits
# 1 if any group is lost, duplicated, trained twice or on other rows, a worker exits fenced, or TQ
# keeps anything. Scale it with CHAOS_ARGS="--groups 100 --kills 4".
.PHONY: chaos drills
chaos: jars
	$(BIN)/python bench/chaos.py $(CHAOS_ARGS)

# Fault drills too long for make test (a broker down past the client's timeouts, for minutes).
drills: jars
	$(BIN)/python -m pytest -q -rs -m drill

# A tiny GRPO run on CPU through the whole pipeline (broker, TQ, reassemblers, Ray rollout actors);
# writes grpo.png and exits 1 if the reward did not rise. Tune it with GRPO_ARGS="--steps 100".
.PHONY: example-grpo
example-grpo: jars
	$(BIN)/rlstream example grpo $(GRPO_ARGS)

clean-venv:
	rm -rf $(VENV)
