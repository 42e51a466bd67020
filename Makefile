# One-command set-up: every target builds the venv it needs (torch pinned first, so no CUDA build is pulled).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.atorch-installed
NPROC ?= 2

.PHONY: demo test bench clean

$(STAMP): pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
		examples/auto_accelerate/train.py --steps 30 --save-strategy outputs/demo_strategy.json

test: $(STAMP)
	$(PY) -m pytest -q -rs tests

bench: $(STAMP)
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/compute.py
	$(PY) benchmarks/model_parallel.py
	$(PY) benchmarks/search_quality.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
