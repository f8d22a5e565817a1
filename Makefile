# One-file entry: `make up` serves, `make test` tests. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup up test lint typecheck proto slow wheel-serve

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

up: setup
	$(VENV)/bin/helexa up

test: setup
	$(VENV)/bin/ruff check .
	$(PY) tests/typecheck.py
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

wheel-serve: setup  # build the wheel, install it non-editable in a fresh venv, serve one request
	bash .ci/wheel-serve

slow: setup
	$(PY) -m pytest -q -m slow

lint: setup
	$(VENV)/bin/ruff check .

typecheck: setup  # mypy over helexa/router/ and helexa/neuron/engine/ ([tool.mypy] in pyproject.toml)
	$(PY) tests/typecheck.py

proto: setup
	$(PY) -m helexa.proto_gen
