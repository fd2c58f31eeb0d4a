#!/usr/bin/env bash
# Runs the whole test suite (slow tests included) in .venv; set it up first with scripts/setup.sh --dev.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=blas_env.sh
source scripts/blas_env.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -q "$@"
