#!/usr/bin/env bash
# Build the nanoserve image with podman on a machine without a Docker engine or an image registry.
#
#   deploy/podman/build.sh                     # -> localhost/nanoserve:latest
#   IMAGE=localhost/nanoserve:dev deploy/podman/build.sh [extra podman build args...]
#
# 1. builds the Debian base image the Dockerfile's FROM names, if missing (build-base.sh, cached);
# 2. `podman build` with the host network (the default bridge network uses a private address range
#    that these machines do not allow), the host's CA bundle mounted for pip's TLS, and pip's local
#    wheel folder (find-links, e.g. /opt/wheels with torch 2.13.0+cpu) mounted read-only so torch
#    comes from disk instead of a multi-GB CUDA download.
# --format docker: OCI image configs have no HEALTHCHECK, docker-format ones do.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$here/containers.conf}"
image="${IMAGE:-localhost/nanoserve:latest}"
base="${BASE_IMAGE:-localhost/nanoserve-base:bookworm}"
ca_bundle="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

BASE_IMAGE="$base" "$here/build-base.sh"

# The wheel folder pip is configured with on this host (PIP_FIND_LINKS or `pip config`), if any.
wheels="${WHEELS_DIR:-${PIP_FIND_LINKS:-}}"
if [[ -z "$wheels" ]] && command -v pip >/dev/null; then
    wheels="$(pip config get global.find-links 2>/dev/null || true)"
fi
wheels="${wheels%% *}"  # the first folder when several are listed

args=(--network host --format docker --layers --build-arg "BASE_IMAGE=$base")
if [[ -f "$ca_bundle" ]]; then
    args+=(-v "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro")
fi
if [[ -n "$wheels" && -d "$wheels" ]]; then
    # torch from the folder only: no extra index to wait for on a machine without one.
    args+=(-v "$wheels:/opt/wheels:ro" --build-arg WHEELS_DIR=/opt/wheels --build-arg "TORCH_INDEX=${TORCH_INDEX:-}")
else
    echo "note: no local wheel folder found; torch comes from the index (TORCH_INDEX / PyPI)" >&2
fi

exec podman build "${args[@]}" -t "$image" -f "$root/Dockerfile" "$@" "$root"
