#!/usr/bin/env bash
# The PyTorch / CUDA path on a machine with an NVIDIA GPU, inside 10 minutes, results as JSON.
#
#   scripts/cuda_check.sh [OUT_DIR]        (default: $OUT when set, else ./cuda_check_out)
#
# 1. env.json: nvidia-smi, python, the chosen interpreter.
# 2. Install, unless the current python already has CUDA torch and transformers 5.x: a venv (.venv-cuda, or
#    $CUDA_CHECK_VENV) with torch from PyPI (CUDA wheels on Linux; $TORCH_SPEC, default torch==2.13.0),
#    transformers==5.24.0, the test tools and this package's non-MLX dependencies, then this package without its
#    dependencies (MLX is not needed; mlx[cpu] is tried best-effort so the `omnitide` CLI and the MLX parity tests
#    can run too).
# 3. pytest tests/torch with OMNITIDE_TORCH_DEVICE=cuda -> pytest_cuda.xml (counts and failures in summary.json).
# 4. omnitide bench attention --backend torch --device cuda at 4K-32K (float16, Qwen2.5-Omni-7B shape) ->
#    bench_attention_torch.json (+ .md); migration rows carry torch.cuda.max_memory_allocated above the buffers.
# 5. summary.json: each stage's status and seconds, test counts, the migration memory check.
#
# Every stage has its own time limit inside a total budget ($CUDA_CHECK_BUDGET_S, default 570 s); a stage that runs
# out of time is recorded as such and the script still writes summary.json.
#
# A dry run of the plumbing without a GPU (no install; small benchmark):
#   CUDA_CHECK_DEVICE=cpu CUDA_CHECK_PYTHON=.venv/bin/python BENCH_SHAPE=minicpm-o-2.6 BENCH_HISTORY=700 \
#       scripts/cuda_check.sh /tmp/cuda_check_dry
set -uo pipefail

cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-cuda_check_out}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
START=$(date +%s)
BUDGET=${CUDA_CHECK_BUDGET_S:-570}
STAGES="$OUT_DIR/stages.tsv"
: > "$STAGES"

left() { echo $(( START + BUDGET - $(date +%s) )); }
cap() { local want=$1 l; l=$(left); (( l < want )) && want=$l; (( want < 1 )) && want=1; echo "$want"; }
stage() {  # stage NAME LIMIT_S CMD...: run with a time limit, log to OUT_DIR/NAME.log, record status and seconds
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s) rc
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$STAGES"
    tail -n 5 "$OUT_DIR/$name.log"
    return $rc
}

# --- 1. environment ---------------------------------------------------------------------------------------------
PY=${CUDA_CHECK_PYTHON:-python3}
DEVICE=${CUDA_CHECK_DEVICE:-cuda}
{
    echo "{"
    echo "\"date\": \"$(date -u +%FT%TZ)\","
    echo "\"nvidia_smi\": $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 \
        | "$PY" -c 'import json,sys; print(json.dumps(sys.stdin.read().strip()))'),"
    echo "\"python\": $("$PY" -c 'import json,sys; print(json.dumps(sys.version))')"
    echo "}"
} > "$OUT_DIR/env.json"
cat "$OUT_DIR/env.json"

# --- 2. install -------------------------------------------------------------------------------------------------
has_cuda_stack() {
    DEVICE="$DEVICE" "$1" - <<'EOF' 2>/dev/null
import os, torch, transformers
assert os.environ["DEVICE"] == "cpu" or torch.cuda.is_available(), "no CUDA"
assert int(transformers.__version__.split(".")[0]) >= 5
import omnitide_mlx.torch.cache  # noqa: F401  (this checkout importable)
EOF
}
if has_cuda_stack "$PY"; then
    printf 'install\t0\t0\n' >> "$STAGES"
    echo "== install: skipped, $PY already has torch (with $DEVICE) and transformers 5"
else
    VENV=${CUDA_CHECK_VENV:-.venv-cuda}
    install() {
        set -e
        [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
        "$VENV/bin/python" -m pip install -q --upgrade pip
        "$VENV/bin/python" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" "transformers==5.24.0" \
            pytest hypothesis numpy safetensors tokenizers huggingface_hub pillow tqdm av soundfile \
            opencv-python-headless
        "$VENV/bin/python" -m pip install -q --no-deps -e .
        "$VENV/bin/python" -m pip uninstall -y -q torchvision 2>/dev/null || true
        timeout 90 "$VENV/bin/python" -m pip install -q "mlx[cpu]>=0.32.4" || echo "mlx[cpu] not installed (optional)"
    }
    stage install "$(cap 300)" bash -c "$(declare -f install); VENV='$VENV' PY='$PY' install"
    PY="$VENV/bin/python"
fi
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
      "transformers", transformers.__version__)' | tee "$OUT_DIR/versions.txt"

# --- 3. the torch tests on CUDA ---------------------------------------------------------------------------------
export OMNITIDE_TORCH_DEVICE=$DEVICE HF_HUB_OFFLINE=1
stage tests "$(cap 240)" "$PY" -m pytest -q tests/torch -p no:cacheprovider -p no:logging \
    --junitxml "$OUT_DIR/pytest_cuda.xml" -o junit_family=xunit2

# --- 4. the attention benchmark at 4K-32K -----------------------------------------------------------------------
BENCH_ARGS=(--backend torch --device "$DEVICE" --dtype "${BENCH_DTYPE:-float16}" --shape "${BENCH_SHAPE:-qwen2.5-omni-7b}"
            --history "${BENCH_HISTORY:-4096,8192,16384,32768}" --json "$OUT_DIR/bench_attention_torch.json"
            --markdown)
OMNITIDE="$(dirname "$PY")/omnitide"
if [ -x "$OMNITIDE" ] && "$PY" -c "import mlx.core" 2>/dev/null; then
    stage bench "$(cap $(( $(left) - 20 )))" "$OMNITIDE" bench attention "${BENCH_ARGS[@]}"
else  # the `omnitide` parser imports the MLX benchmark module; without MLX call the torch benchmark directly
    stage bench "$(cap $(( $(left) - 20 )))" "$PY" -m omnitide_mlx.torch.bench "${BENCH_ARGS[@]:2}"
fi
sed -n '/^| history/,$p' "$OUT_DIR/bench.log" > "$OUT_DIR/bench_attention_torch.md" 2>/dev/null || true

# --- 5. summary -------------------------------------------------------------------------------------------------
"$PY" - "$OUT_DIR" <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET

out = sys.argv[1]
stages = {}
for line in open(os.path.join(out, "stages.tsv")):
    name, rc, secs = line.rstrip("\n").split("\t")
    status = "ok" if rc == "0" else "timeout" if rc in ("124", "137") else f"failed (exit {rc})"
    stages[name] = {"status": status, "seconds": int(secs)}
summary = {"stages": stages}
try:
    root = ET.parse(os.path.join(out, "pytest_cuda.xml")).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    cases = suite.findall("testcase")
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("failure") is not None
              or c.find("error") is not None]
    summary["tests"] = {"total": len(cases), "failed": failed,
                        "skipped": sum(c.find("skipped") is not None for c in cases)}
except (OSError, ET.ParseError, AttributeError) as e:
    summary["tests"] = {"error": f"no junit report ({e})"}
try:
    bench = json.load(open(os.path.join(out, "bench_attention_torch.json")))
    mig = [r for r in bench["rows"] if r["phase"] == "migration" and "rows" in r]
    summary["migration_memory"] = [
        {"history": r["history"], "layout": r["layout"], "rows": r["rows"], "moved_bytes": r["moved_bytes"],
         "buffer_bytes": r["buffer_bytes"], "peak_extra_bytes": r["peak_extra_bytes"],
         "only_moved_rows": r["peak_extra_bytes"] is not None and r["peak_extra_bytes"] <= r["moved_bytes"] + (1 << 20)}
        for r in mig]
    summary["bench_errors"] = [r for r in bench["rows"] if "error" in r]
    summary["bench_wall_s"] = bench["wall_s"]
except (OSError, ValueError, KeyError) as e:
    summary["bench"] = f"no benchmark result ({e})"
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(summary, indent=1)[:4000])
EOF
echo "results in $OUT_DIR (total $(( $(date +%s) - START )) s)"
