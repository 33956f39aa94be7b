# `make run` and `make test` are all a fresh machine needs (README quick start).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-fast mutation mutation-pure lint install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch is pinned to the CPU build that lies on this machine's disk; the
	# project's own pin keeps pip from resolving a multi-GB CUDA build.
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test,data]'
	# llm-analysis runs beside the planner in benchmarks/validate_planner.py; its metadata pins old
	# transformers and huggingface-hub it does not need, so it comes without its dependencies
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-analysis==0.2.2 fire==0.5.0 termcolor six
	# the lab's browser tests run in Debian's chromium
	command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	touch $(STAMP)

install: $(STAMP)

# A fresh run directory each time: runs/small-tp2-pp2-dp2-<time>.
run: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/fourd train --config configs/run.toml

# Lint, format and type checks first (seconds), then the suite.
lint: $(STAMP)
	$(BIN)/ruff check fourd tests benchmarks
	$(BIN)/ruff format --check fourd tests benchmarks
	$(BIN)/mypy fourd

test: lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "not mutation" --durations=15 tests

# Everything but the multi-process tests (marked slow).
test-fast: lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "not slow and not mutation" tests

# Deliberate mutations of the source, each of which a named test must catch (tests/test_mutations.py).
mutation: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -v -s -p no:cacheprovider tests/test_mutations.py

# cosmic-ray's mutants of the pure-Python modules, each against its own fast tests, cached per module in
# .mutation/ (tests/mutation_pure.py; docs/testing.md has the figures). Not part of `make test`.
mutation-pure: $(STAMP)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[mutation]'
	OMP_NUM_THREADS=1 $(BIN)/python tests/mutation_pure.py $(MODULES)

clean:
	rm -rf $(VENV) runs
