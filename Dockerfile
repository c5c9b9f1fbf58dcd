# nanoserve: an HTTP text-generation server for small GPT models, CPU torch by default.
#
#   docker build -t nanoserve .       # any Docker host with registry access: python:3.11-slim, CPU torch
# Without a registry (no Docker engine either), with podman and a locally built Debian base:
#   deploy/podman/build.sh            # builds the base from packages first, then this file
# GPU hosts: a CUDA build of torch instead of the CPU one (see docs/operations.md):
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t nanoserve:cuda .
#
# Configuration is only through NANOSERVE_* environment variables (`nanoserve serve --help` lists them).

# The base must provide python3 with the venv module, on Debian (the app stage uses apt-get).
# 3.11: the Python the test suite runs on. deploy/podman/build.sh passes its own local base.
ARG BASE_IMAGE=python:3.11-slim

# ------------------------------------------------ requirements: the runtime dependency list only
# Read from pyproject.toml in its own stage: the file changes often (tool settings, dev extras), the
# list rarely, and the slow install below is cached on the list's content, not on the whole file.
FROM ${BASE_IMAGE} AS requirements
WORKDIR /src
COPY pyproject.toml ./
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /requirements.txt

# ------------------------------------------------ deps: a venv with torch and the dependencies
# Also the runtime's base (below), so the 1.2 GB venv is never copied between stages: with a layer
# cache, checking a `COPY --from` of it means hashing all of it on every build.
FROM ${BASE_IMAGE} AS deps

# TORCH_SPEC: which torch release. TORCH_INDEX: an extra wheel index to take it from; by default
# PyTorch's CPU index, whose local-version builds (2.13.0+cpu) sort above PyPI's, so no multi-GB
# CUDA build is pulled (an empty value: PyPI alone). WHEELS_DIR: a folder of local wheels mounted
# at build time (podman build -v), used when present.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG WHEELS_DIR=/opt/wheels
# Build-time pip settings: ARGs reach RUN's environment but, unlike ENV, stay out of the image.
ARG PIP_DISABLE_PIP_VERSION_CHECK=1
ARG PIP_DEFAULT_TIMEOUT=180
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ARG PIP_FIND_LINKS=${WHEELS_DIR}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# hadolint ignore=DL3013  # pinned: TORCH_SPEC is an exact version (torch==X.Y.Z), hadolint cannot see through the arg
RUN pip install --no-cache-dir ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "$TORCH_SPEC" \
    && python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
COPY --from=requirements /requirements.txt /tmp/requirements.txt
RUN pip install --no-cache-dir -r /tmp/requirements.txt

# ------------------------------------------------ app: the project's own code, outside the venv
# Installed into its own folder, so a code change rebuilds one small layer of the runtime image.
FROM deps AS app
# A C compiler for the native step (nanoserve/engine/native/decode.c, built by the install
# below): in this stage only, so the runtime image gets the built library but not the compiler.
# hadolint ignore=DL3008  # Debian's current gcc of the release the base was built from; nothing else to pin against
RUN apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY nanoserve/ nanoserve/
# setuptools came with torch, so no isolated build environment is downloaded.
RUN pip install --no-cache-dir --no-deps --no-build-isolation --target /opt/app . \
    && PYTHONPATH=/opt/app python -c "import nanoserve.model.gpt, nanoserve.cli" \
    && ls /opt/app/nanoserve/engine/native/_decode*.so

# ------------------------------------------------ assets: the default checkpoint and the health check
# The checkpoint: config, weights, tokenizer, card (.dockerignore leaves out optimizer state). Made
# world-readable here: a trainer may write its files 0600, and the server runs as non-root.
FROM ${BASE_IMAGE} AS assets
COPY checkpoints/shakespeare-char/ /opt/checkpoints/shakespeare-char/
COPY deploy/image/healthcheck.py /opt/nanoserve/healthcheck.py
RUN chmod -R a+rX /opt/checkpoints /opt/nanoserve

# ------------------------------------------------ runtime: the venv + checkpoint + code, nothing else
FROM deps

LABEL org.opencontainers.image.title="nanoserve" \
      org.opencontainers.image.description="HTTP text-generation server for small GPT models" \
      org.opencontainers.image.licenses="MIT"

# A fixed numeric uid/gid, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
RUN groupadd --system --gid 10001 nanoserve \
    && useradd --no-log-init --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin nanoserve

# The checkpoint changes more rarely than the code, which comes last (below).
COPY --from=assets /opt/checkpoints /opt/checkpoints
COPY --from=assets /opt/nanoserve /opt/nanoserve

# Everything the process may write goes to /tmp, so the root file system can be read-only
# (Kubernetes mounts an emptyDir there). Bytecode was compiled by pip at build time.
ENV PATH=/opt/app/bin:$PATH \
    PYTHONPATH=/opt/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    TMPDIR=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    MPLCONFIGDIR=/tmp/matplotlib \
    NANOSERVE_HOST=0.0.0.0 \
    NANOSERVE_PORT=8000 \
    NANOSERVE_CHECKPOINT=/opt/checkpoints/shakespeare-char

USER 10001:10001
WORKDIR /tmp
EXPOSE 8000

# Ready = checkpoint loaded, warmed up and not draining. Plain Python: the image has no curl.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "/opt/nanoserve/healthcheck.py"]

# Exec form: the server is PID 1 and receives SIGTERM itself, then drains in-flight requests.
ENTRYPOINT ["nanoserve"]
CMD ["serve"]

# Last, because it changes most often: a code change rebuilds only this small layer (files stay
# root-owned and read-only to the server's user; COPY ignores USER).
COPY --from=app /opt/app /opt/app
