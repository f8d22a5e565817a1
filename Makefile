# One-file entry: `make up` serves, `make test` tests. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup up test lint typecheck proto slow wheel-serve

setup: $(VENV)/.installed $(VENV)/fla/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# fla-core as the cuda extra pins it, beside the venv, not in it (so no CPU process imports
# it): tests/kernels/test_fla_real.py runs its kernels in Triton's interpreter
FLA_PIN = $(PY) -c 'import tomllib; e = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["cuda"]; print(next(d for d in e if d.startswith("fla-core")))'
$(VENV)/fla/.installed: $(VENV)/.installed
	rm -rf $(VENV)/fla
	$(PY) -m pip install -q --no-deps --target $(VENV)/fla einops==0.8.2 "$$($(FLA_PIN))"
	touch $@

up: setup
	$(VENV)/bin/helexa up

# Python's bytecode cache on for the tests even where the environment turns it off
# (PYTHONDONTWRITEBYTECODE): the suite starts many helexa processes, and each compiled
# every module it imports again (test_small_endpoints.py: 36.0 s of CPU off, 29.9 s on)
test: setup
	$(VENV)/bin/ruff check .
	$(PY) tests/typecheck.py
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

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
