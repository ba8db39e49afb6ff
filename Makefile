# Two commands set everything up from nothing: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[cli,hf,bench,dev]"
	touch $(STAMP)

# One OpenMP thread: the digits model is tiny, and a second thread only adds synchronisation cost.
run: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/tunefree train --dataset digits --epsilon 3 --out runs/digits

test: setup
	$(VENV)/bin/ruff check src tests $(wildcard benchmarks)
	$(PY) -m pytest -q

# The fast tier, on two worker processes: every test but those marked slow, distributed or hf
# (pyproject.toml); the exactness matrix and the privacy invariants stay in it. `make test` runs them all.
test-fast: setup
	$(VENV)/bin/ruff check src tests $(wildcard benchmarks)
	$(PY) -m pytest -q -n 2 -m "not slow and not distributed and not hf"

lint: setup
	$(VENV)/bin/ruff check src tests $(wildcard benchmarks)

bench: setup
	$(PY) benchmarks/engine_overhead.py --rounds 3 --steps 10

clean:
	rm -rf $(VENV) runs
