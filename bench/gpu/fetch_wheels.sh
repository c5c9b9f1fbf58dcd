#!/usr/bin/env bash
# Run here (with PyPI), before the device call: downloads bench/gpu/wheels.txt's wheels for the device
# machine (x86-64, CPython 3.12) into .whl/, which git ignores (.git/info/exclude) and the device call
# carries. Wheels are never committed.
#   bench/gpu/fetch_wheels.sh [PYTHON]     (PYTHON: any python with pip; default python3)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
py="${1:-python3}"
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
rm -rf .whl && mkdir -p .whl
grep -v '^\s*\(#\|$\)' bench/gpu/wheels.txt | xargs "$py" -m pip download --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl
ls .whl
du -sh .whl
