# One-command set-up: every target builds the venv it needs.
# Exact versions come from constraints.txt (pyproject.toml has ranges only). torch goes in first,
# pinned, so pip takes the CPU wheel on disk (or a CUDA wheel you have cached) instead of resolving
# a multi-GB CUDA build. A venv that already has a torch keeps it: `make test VENV=/path/to/env`
# installs atorch around your torch, and stops with a resolver error if that torch is too old
# rather than replacing it.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.atorch-installed
CONSTRAINTS := constraints.txt
KEEP_TORCH := $(VENV)/constraints-keep-torch.txt
NPROC ?= 2

.PHONY: demo test test-unit test-multirank bench conformance clean

$(STAMP): pyproject.toml setup.py $(CONSTRAINTS)
	@if [ ! -x $(PY) ]; then \
		python3 -m venv $(VENV) && $(PY) -m pip install -q -c $(CONSTRAINTS) --upgrade pip; \
	fi
	@if $(PY) -c 'import torch' 2>/dev/null; then \
		version=$$($(PY) -c 'import torch; print(torch.__version__)'); \
		echo "keeping the torch already in $(VENV): $$version"; \
		sed '/^# >>> torch/,/^# <<< torch/d' $(CONSTRAINTS) > $(KEEP_TORCH); \
		echo "torch==$$version" >> $(KEEP_TORCH); \
		$(PY) -m pip install -q -c $(KEEP_TORCH) -e '.[test]' || { \
			echo "atorch was not installed: pip could not fit it around torch $$version, which is kept"; \
			echo "(atorch needs torch >= 2.7; see docs/install.md)"; exit 1; }; \
	else \
		$(PY) -m pip install -q -c $(CONSTRAINTS) torch && \
		$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[test]'; \
	fi
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
		examples/auto_accelerate/train.py --steps 30 --save-strategy outputs/demo_strategy.json

# ruff (lint and import order; config in pyproject.toml) first: a finding fails the target. The suite
# runs on two pytest workers, a test file to a worker (half its time is spent waiting on processes it
# launched); the `solo` tests, which read their own processes' timings or memory or wait on timeouts,
# run after it, alone. Both parts always run; either failing fails the target.
WORKERS ?= 2
test: $(STAMP)
	$(PY) -m ruff check .
	@status=0; \
	$(PY) -m pytest -q -rs --durations=25 -n $(WORKERS) --dist loadfile -m "not solo" tests || status=1; \
	$(PY) -m pytest -q -rs --durations=10 -m solo tests || status=1; \
	exit $$status

# the two halves of the suite (tests/README.md): one process each, and the tests that launch ranks
test-unit: $(STAMP)
	$(PY) -m pytest -q -rs tests -m "not multirank"

test-multirank: $(STAMP)
	$(PY) -m pytest -q -rs tests -m multirank

# every method on every model of the zoo; rewrites docs/models.md (the suite checks it is current)
conformance: $(STAMP)
	$(PY) -m atorch.testing.conformance --write docs/models.md

# every benchmark at full size (tests/project/test_benchmarks.py runs each in its smallest mode)
bench: $(STAMP)
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/compute.py
	$(PY) benchmarks/model_parallel.py
	$(PY) benchmarks/checkpoint.py
	$(PY) benchmarks/host_memory.py
	$(PY) benchmarks/search_quality.py
	$(PY) benchmarks/plan_vs_published.py
	$(PY) benchmarks/elementwise_traffic.py
	$(PY) benchmarks/compiled_activations.py
	$(PY) benchmarks/compiled_loss.py
	$(PY) benchmarks/gpu.py

clean:  # a VENV you pointed at yourself is never deleted: only what make added to it
ifeq ($(VENV),.venv)
	rm -rf $(VENV) outputs .pytest_cache
else
	rm -f $(STAMP) $(KEEP_TORCH)
	rm -rf outputs .pytest_cache
endif
