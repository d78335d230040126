# The two front-door commands are `make demo` and `make test`; both install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.auxout-installed
export VLLM_CPU_KVCACHE_SPACE ?= 1
export PYTHONUNBUFFERED := 1

.PHONY: install demo rl test test-fast test-slow lint fuzz bench clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	VENV=$(VENV) bash scripts/install.sh

demo: install
	$(PY) -m auxout.cli demo

# GRPO with routing replay (TRL, colocated vLLM) on a toy task, 3 seeds: out/rl/rl.json and rl.png
rl: install
	$(PY) -m auxout.cli rl

test: install lint
	$(PY) -m pytest -q

# core and stores only (no vLLM engine): the quick loop while developing
test-fast: install
	$(PY) -m pytest -q -m "not vllm and not slow"

test-slow: install
	$(PY) -m pytest -q -m slow

lint: install
	$(VENV)/bin/ruff check auxout tests benchmarks scripts
	$(VENV)/bin/mypy

# long property run (>= 10,000 random schedules); result recorded in docs/testing.md
fuzz: install
	HYPOTHESIS_PROFILE=fuzz AUXOUT_FUZZ_EXAMPLES=$${AUXOUT_FUZZ_EXAMPLES:-10000} \
		$(PY) -m pytest -q -p no:cacheprovider tests/core/test_sim_properties.py

# the benchmarks with a target (docs/performance.md), each against a baseline measured in the same run
bench: install
	$(PY) benchmarks/dataplane.py
	$(PY) benchmarks/stores.py
	$(PY) benchmarks/engine_overhead.py
	$(PY) benchmarks/wire.py

clean:
	rm -rf $(VENV) out .pytest_cache .mypy_cache .ruff_cache .hypothesis
