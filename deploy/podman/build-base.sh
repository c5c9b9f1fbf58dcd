#!/usr/bin/env bash
# Build the base image the Dockerfile's FROM line names, from Debian packages, with no image registry:
# debootstrap a minimal bookworm root file system with python3 + venv + CA certificates and
# `podman import` it. Cached: does nothing when the image already exists (FORCE=1 rebuilds).
#
#   deploy/podman/build-base.sh                      # localhost/nanoserve-base:bookworm
#   BASE_IMAGE=localhost/other:tag deploy/podman/build-base.sh
#   DEBIAN_MIRROR=http://your.mirror/debian deploy/podman/build-base.sh
#
# Bookworm's python3 is CPython 3.11, the version of the CPU torch wheel the image installs.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$here/containers.conf}"
image="${BASE_IMAGE:-localhost/nanoserve-base:bookworm}"
suite="${DEBIAN_SUITE:-bookworm}"
packages="python3,python3-venv,ca-certificates"

if [[ "${FORCE:-0}" != 1 ]] && podman image exists "$image"; then
    echo "base image $image exists (FORCE=1 rebuilds)"
    exit 0
fi
if [[ $EUID -ne 0 ]]; then
    echo "error: debootstrap needs root (run with sudo, or pull python:3.11-slim and build with BASE_IMAGE)" >&2
    exit 1
fi
command -v debootstrap >/dev/null || { echo "error: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }

rootfs="$(mktemp -d /var/tmp/nanoserve-base.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT

echo "debootstrap $suite ($packages) into $rootfs"
# minbase: dpkg, apt and essential packages only; no init system, no recommends.
# Without DEBIAN_MIRROR, debootstrap uses its own default mirror.
debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" ${DEBIAN_MIRROR:+"$DEBIAN_MIRROR"} \
    >"$rootfs.log" 2>&1 || { tail -n 30 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
rm -f "$rootfs.log"

# What an image does not need: package caches and lists, docs, man pages, logs.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/var/log/*.log "$rootfs"/tmp/*

tar --numeric-owner -C "$rootfs" -c . | podman import --quiet \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase $suite + $packages" \
    - "$image" >/dev/null
echo "built $image: $(podman image inspect --format '{{.Size}}' "$image") bytes"
