# One-command set-up for a fresh machine (see README).
#   make test   creates .venv from the project's files, installs, runs the whole suite
#   make demo   creates .venv, installs, runs the example PPO job
# A torch already importable from the interpreter (e.g. a CUDA build) is kept: only then does the venv see the
# system site-packages; otherwise the venv is isolated and the pinned CPU wheel is installed first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.ppo-core-installed

.PHONY: install test test-fast lint format demo bench clean

$(STAMP): pyproject.toml
	if $(PYTHON) -c "import torch" 2>/dev/null; then \
		$(PYTHON) -m venv --system-site-packages $(VENV); else $(PYTHON) -m venv $(VENV); fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,monarch,megatron,hf,ray,examples,dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	HYPOTHESIS_PROFILE=dev $(PY) -m pytest -q -x

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

demo: $(STAMP)
	$(PY) examples/ppo_digits.py

bench: $(STAMP)
	$(PY) benchmarks/advantages.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache *.egg-info
