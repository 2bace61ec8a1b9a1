# The two set-up commands (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test test-all

# Creates .venv at the repository root if it is missing; reinstalls when pyproject.toml changes.
# torch is named first so pip takes the pinned CPU build rather than resolving a CUDA one.
$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0 -e '.[test,plots,cluster,serve]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/specfit demo

# two worker processes: every test runs torch on one thread (tests/conftest.py), so one process
# left the second core idle (12.5 against 6.9 minutes on 2 cores)
test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -n 2

test-all: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -n 2 -m ''
