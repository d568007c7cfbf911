# Two commands for a fresh machine: `make demo` and `make test`. Both create or reuse .venv and
# fetch the Kafka jars into ~/.cache/rlstream once; pip's cache serves torch on later installs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rlstream-installed

.PHONY: help test test-unit test-verl lint demo bench jars clean-venv
.DEFAULT_GOAL := help

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z][a-z-]*:.*## / {printf "  make %-13s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# nemo-gym: NeMo Gym's token-staging contract, the reference the NeMo Gym adapter and its tests are held
# to. The wheel declares Python >= 3.13 and serving dependencies (openai, mlflow, ray, ...) that
# nemo_gym.token_id_capture.staging never imports; it needs only pydantic (Ray's) and orjson.
$(STAMP): pyproject.toml setup.py schemas/_rowcopy.c
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --progress-bar off -e '.[dev]'
	$(BIN)/python -m pip install --progress-bar off --no-deps --ignore-requires-python 'nemo-gym==0.7.0' 'orjson>=3.10,<4'
	@touch $@

jars: $(STAMP) ## the environment .venv and the locked Kafka jars (make test and make demo do it)
	$(BIN)/rlstream broker fetch

# Three processes on 2 cores, whole files each (so a file's module fixtures start once): the suite
# mostly waits on brokers, timeouts and child processes (a third of the CPU busy with two), and
# a third process took it from 15:58 to 13:44. `TEST_ARGS=-n0` runs serially.
test: jars ## the whole suite against a real Kafka broker and real Ray/TQ
	$(BIN)/python -m pytest -q -rs -n 3 --dist loadfile $(TEST_ARGS)

# Pure code only: no broker, no Ray.
test-unit: $(STAMP) ## pure code only, no broker or Ray (under a minute)
	$(BIN)/python -m pytest -q -rs tests/unit

# verl 0.9.1 pins tensordict<=0.10, so its tests get their own environment (.venv-verl) beside the
# project; the stamp makes a warm run skip pip. tests/verl is never collected by `make test`.
VERL_VENV := .venv-verl
VERL_STAMP := $(VERL_VENV)/.rlstream-verl-installed
$(VERL_STAMP): pyproject.toml setup.py schemas/_rowcopy.c
	@test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VERL_VENV)/bin/python -m pip install --progress-bar off 'tensordict==0.10.0' -e '.[dev,verl]'
	@touch $@

test-verl: $(VERL_STAMP) ## tests/verl inside real verl 0.9.1 on CPU (its own .venv-verl)
	$(VERL_VENV)/bin/python -m pytest -q -rs -p no:xdist tests/verl $(TEST_ARGS)

lint: $(STAMP) ## ruff check and format, as CI enforces
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

demo: jars ## the whole pipeline locally, every group accounted for (about a minute)
	$(BIN)/rlstream demo

bench: jars ## every benchmark, printing its figures (bench/README.md; about 35 minutes)
	$(BIN)/python -m bench.codec
	$(BIN)/python -m bench.pipeline
	$(BIN)/python -m bench.restore
	$(BIN)/python -m bench.resume
	$(BIN)/python -m bench.progress
	$(BIN)/python -m bench.dataplane
	$(BIN)/python -m bench.scaling
	$(BIN)/python -m bench.failover

# The chaos drill, outside `make test`: 2,000 groups (10% lost to the admission gate) through a pool of
# SIGKILLed reassemblers (every crash point, random instants taken over by the spare), a zombie, a
# worker frozen mid-step, a frozen transaction coordinator, a broker kill -9 and a trainer kill; exits
# 1 if any group is lost, duplicated, trained twice or on other rows, a worker exits fenced, or TQ
# keeps anything. Scale it with CHAOS_ARGS="--groups 100 --kills 4".
.PHONY: chaos drills
chaos: jars ## the chaos drill at full size (2,000 groups; CHAOS_ARGS to scale it)
	$(BIN)/python -m tests.tools.chaos $(CHAOS_ARGS)

# Fault drills too long for make test (a broker down past the client's timeouts, for minutes).
drills: jars ## the fault drills too long for make test (minutes each)
	$(BIN)/python -m pytest -q -rs -m drill

# The explorer (tests/tools/explore): seeded runs of the real components on the Kafka and TQ models,
# faults at every point they wait, every invariant checked; a failure is shrunk and saved as a
# replayable seed file under .explore/failures/. No broker, no Ray. `make test` runs 40 seeds and
# the seeds of every bug found (tests/explore_seeds/). Scale it: EXPLORE_ARGS="--seeds 5000 --minutes 60".
.PHONY: explore
explore: $(STAMP) ## seeded fault exploration on the models (EXPLORE_ARGS="--seeds N --minutes M")
	PYTHONHASHSEED=0 $(BIN)/python -m tests.tools.explore $(EXPLORE_ARGS)

# A tiny GRPO run on CPU through the whole pipeline (broker, TQ, reassemblers, Ray rollout actors);
# writes grpo.png and exits 1 if the reward did not rise. Tune it with GRPO_ARGS="--steps 100".
.PHONY: example-grpo
example-grpo: jars ## a tiny GRPO run on CPU that learns through the pipeline (GRPO_ARGS)
	$(BIN)/rlstream example grpo $(GRPO_ARGS)

clean-venv: ## remove .venv
	rm -rf $(VENV)
