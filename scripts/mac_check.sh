#!/usr/bin/env bash
# The Mac check: on Apple silicon, from a source checkout set up with scripts/setup.sh --dev, run
#   scripts/mac_check.sh                 # tests/metal, omnitide doctor, bench attention x every path, both shapes
#   scripts/mac_check.sh --dry           # the same with the reference path only (any machine; what CI runs)
# and send back the folder it prints (mac_check.json + mac_check.md + doctor.json). Flags: --help.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
source scripts/blas_env.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
exec "$PY" -m omnitide_mlx.bench.mac_check "$@"
