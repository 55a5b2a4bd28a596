# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv, install MergePipe into it, then run.

VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU wheel keeps set-up fast on machines without a GPU; override with
# TORCH=torch (or your CUDA build) where you want one.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench bench-quick clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mergepipe demo --workdir demo-out

test: $(STAMP)
	$(PY) -m pytest -q

bench-quick: $(STAMP)
	$(PY) -m benchmarks.suite --quick

bench: $(STAMP)
	$(PY) -m benchmarks.suite

clean:
	rm -rf demo-out benchmarks/results .pytest_cache
