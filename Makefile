# The two set-up commands of the README. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

demo: $(BIN)/python
	$(BIN)/pip install --quiet -e ".[demo]"
	$(BIN)/kuat demo

test: $(BIN)/python
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

bench: $(BIN)/python
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/kuat bench --quick

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
