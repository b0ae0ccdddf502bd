# The two set-up commands of the README. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint bench parity clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

demo: $(BIN)/python
	$(BIN)/pip install --quiet -e ".[demo]"
	$(BIN)/kuat demo

test: $(BIN)/python
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=25

bench: $(BIN)/python
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/kuat bench --quick

# Opt-in, not part of `make test`: torch's and torchdata's own loader suites on kuat.DataLoader
# (docs/loader.md, "Parity with torch's own tests"). Point KUAT_PARITY_TORCH_TEST and
# KUAT_PARITY_TORCHDATA_TEST at local copies of the two test files: no test code is fetched.
PARITY_MODES ?= thread,process
parity: $(BIN)/python
	$(BIN)/pip install --quiet -e ".[parity]"
	$(BIN)/python -m benchmarks.parity --modes $(PARITY_MODES)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
