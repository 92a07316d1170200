# `make test` and `make demo` each work on a fresh machine with Python 3.11 and pip:
# they create .venv if missing and install the package with its extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo fuzz bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[mlx,jax,dev,clients,render]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) examples/qwen38_attention.py

# The differential fuzzer beyond CI's 2,000 graphs: `make fuzz N=100000 SEED=1 JOBS=2` prints its rate and,
# on a failure, a shrunk reproducer with its replay command (tests/fuzz).
N ?= 100000
SEED ?= 0
JOBS ?= 2
fuzz: $(STAMP)
	$(PY) -m tests.fuzz --n $(N) --seed $(SEED) --jobs $(JOBS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
