# Two commands on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU build of torch first: an unpinned torch could resolve to a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install serve test lint cwarnings bench gpu-wheels gpu-dry-run clean

# decode.c and the parts it includes: `pip install -e .` compiles the native decode step, so a
# change to them reinstalls.
$(VENV)/.installed: pyproject.toml $(wildcard service/engine/native/*.c service/engine/native/*.h)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/nanoserve serve

test: install
	$(PY) -m pytest -q

lint: install cwarnings
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The native step compiles clean with warnings on (pyproject builds it with the same flags, without
# -Werror so that a newer compiler's new warning never stops an install).
cwarnings:
	$(CC) -O3 -std=c11 -Wall -Wextra -Werror -fPIC -c service/engine/native/decode.c -o /dev/null

bench: install
	$(PY) -m bench.engine_throughput

# The GPU check (bench/gpu/README.md): the wheels the GPU machine lacks, fetched into .whl/ and
# checked against every requirement, and the check's dry run on this CPU.
gpu-wheels: install
	bench/gpu/fetch_wheels.sh $(PY)
	$(PY) -m bench.gpu.wheels

gpu-dry-run: install
	PYTHON=$(PY) bench/gpu/run.sh --dry-run

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
