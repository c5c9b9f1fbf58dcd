# Two commands on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU build of torch first: an unpinned torch could resolve to a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install serve test lint cwarnings bench clean

# decode.c and the parts it includes: `pip install -e .` compiles the native decode step, so a
# change to them reinstalls.
$(VENV)/.installed: pyproject.toml $(wildcard service/engine/native/*.c service/engine/native/*.h)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e '.[dev]'
	# TGI's own client for the compatibility tests: its metadata pins huggingface_hub<1, which
	# current transformers refuses, and it runs fine beside newer hub versions.
	$(PIP) install --quiet --no-deps 'text-generation>=0.7,<1'
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
	$(PY) bench/engine.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
