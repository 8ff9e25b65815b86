#!/usr/bin/env bash
# Thin wrapper of bench/gpu_check.py (docs/gpu.md): installs the wheels bench/fetch_gpu_wheels.sh put in
# .whl/ (for this run only, into /tmp/site) when the image lacks them, then runs the one Python process.
#
#   bash bench/gpu_check.sh              # on a GPU machine: rows to $OUT (default bench/results/gpu-check-<date>)
#   bash bench/gpu_check.sh --dry-run    # anywhere: CPU, tiny shapes, the same plumbing
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=python3
if compgen -G ".whl/*.whl" >/dev/null && ! "$PY" -c "import liger_kernel, cut_cross_entropy" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PY" bench/gpu_check.py "$@"
