# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install the project into it.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The engine side needs torch. On a machine without a GPU this must be the CPU build:
# `pip install torch==2.13.0` takes the CPU wheel where one is provided locally.
# A GPU host sets TORCH_SPEC to the build it wants (or installs torch itself first).
TORCH_SPEC ?= torch==2.13.0
# The tests also load a tiny transformers model (the hf extra: --hf-model), so it is installed too.

.PHONY: demo test install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	@$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/pip install --quiet '$(TORCH_SPEC)'
	$(BIN)/pip install --quiet -e '.[engine,test,hf]'
	@touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/remote-dspark demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@./scripts/ensure-prometheus
	$(BIN)/python -m pytest -q -rs -n auto --dist loadgroup

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
