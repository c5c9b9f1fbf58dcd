#!/usr/bin/env bash
# The GPU check in one command: installs the carried wheels, then runs python -m bench.gpu.check
# (every step, under one time budget) with its results in $OUT.
#   bench/gpu/run.sh [--only STEPS] [--budget-s S]   on the GPU machine (.whl/ carried; README.md)
#   bench/gpu/run.sh --dry-run                       here, on the CPU: no wheels, small shapes
# PYTHON names the interpreter (default python3; the GPU image's python3 holds torch).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
PY="${PYTHON:-python3}"
OUT="${OUT:-$PWD/.gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
case " $* " in
  *" --dry-run "*) ;;  # here: the environment already has every dependency
  *)
    if ! ls .whl/*.whl >/dev/null 2>&1; then
      echo "no wheels in .whl/: run bench/gpu/fetch_wheels.sh before the device call and carry .whl" >&2
      exit 2
    fi
    # The device README's install line: no index, no dependency resolution, into a folder of its own.
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || exit 2
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
    # A carried package whose requirement the image's version misses (say pytest-asyncio's pytest) is
    # named here, before a step fails on it; the image's own unrelated conflicts are left out.
    "$PY" -m pip check 2>&1 | grep -iE "$(sed -n 's/==.*//p' bench/gpu/wheels.txt | paste -sd'|')" || true
    ;;
esac
# The driver keeps its own budget; this is only a backstop should it hang itself.
exec timeout -k 5 "${GPU_CHECK_BACKSTOP_S:-460}" "$PY" -m bench.gpu.check --out "$OUT" "$@"
