#!/usr/bin/env bash
# The main job: stream the bundled sample clip (10 s, a changing scene and speech) through an omni model with
# OmniTide retention, asking questions at given times, and write the answers and the per-update KV figures to
# results/stream.json; then the same clip with spoken questions, answered as a conversation (results/voice.json).
# The model is $OMNITIDE_MODEL if set, else Qwen/Qwen2.5-Omni-3B when it is in the local Hugging Face cache
# (a Mac with the weights), else a tiny random checkpoint in the released layout (answers are then noise).
set -euo pipefail
cd "$(dirname "$0")/.."
model="${OMNITIDE_MODEL:-}"
if [ -z "$model" ]; then
  if HF_HUB_OFFLINE=1 .venv/bin/python -c "from huggingface_hub import snapshot_download as s; s('Qwen/Qwen2.5-Omni-3B', local_files_only=True, allow_patterns=['config.json'])" >/dev/null 2>&1; then
    model="Qwen/Qwen2.5-Omni-3B"
  else
    .venv/bin/python scripts/make_tiny_checkpoints.py >/dev/null
    model="checkpoints/tiny-qwen2.5-omni"
    echo "No real model in the local Hugging Face cache: streaming through $model, a tiny random checkpoint in the"
    echo "released layout (answers are noise; token layouts, KV sizes and retention are real). Set OMNITIDE_MODEL"
    echo "to a folder or Hub id (e.g. Qwen/Qwen2.5-Omni-3B) to use real weights."
  fi
fi
source scripts/blas_env.sh
set -x
.venv/bin/omnitide stream --model "$model" --video assets/media/video_10s_av.mp4 \
  --ask "3:What colour is the background?" --ask "6:What is the capital of France, according to the speaker?" \
  --ask "10:Which words have appeared on the screen?" --high 1500 --low 1000 --max-tokens 32 --stats \
  --json results/stream.json
# A spoken conversation on the same clip: its soundtrack replaced by two spoken questions (at 0.8 s and 5.2 s);
# a voice-activity detector hears each one end and the model answers it (results/voice.json records the turns).
.venv/bin/omnitide stream --model "$model" --video assets/media/video_10s_av.mp4 \
  --audio assets/media/spoken_questions_10s.flac --voice --high 1500 --low 1000 --max-tokens 32 \
  --json results/voice.json
