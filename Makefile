# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install the project into it.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The engine side needs torch, installed first so that the extras below keep it and pull no
# other build. TORCH_SPEC is pip's requirement for it; empty means scripts/install-torch's
# default: torch==2.13.0, and on a Linux x86-64 machine without an NVIDIA GPU the CPU build
# torch==2.13.0+cpu (a spec there that names no `+cpu` build is refused: never a CUDA build
# on a CPU machine). TORCH_INDEX is the index torch comes from (pip's --index-url), e.g.
# https://download.pytorch.org/whl/cpu, which carries the CPU builds the PyPI index lacks.
# A .venv that has torch already keeps it.
TORCH_SPEC ?=
TORCH_INDEX ?=
# The tests also load a tiny transformers model (the hf extra: --hf-model), so it is installed too.

.PHONY: demo test install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	@./scripts/install-torch '$(BIN)/python' '$(TORCH_SPEC)' '$(TORCH_INDEX)'
	@echo "== installing remote-dspark (editable) with the extras engine, test and hf"
	$(BIN)/pip install -e '.[engine,test,hf]'
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
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
