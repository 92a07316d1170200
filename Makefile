# `make test` and `make demo` each work on a fresh machine with Python 3.11 and pip:
# they create .venv if missing and install the package with its extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[mlx,jax,dev,clients,render,zoo]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) examples/qwen38_attention.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
