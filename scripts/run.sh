#!/usr/bin/env bash
# Sets up and runs the ds4 service in the foreground.
#   scripts/run.sh [--model FILE]
# Without a model it serves ../shared/models/stories260K.gguf when present,
# else a small synthetic model (random weights) made by ds4-mkmodel.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
model=""
if [ "${1:-}" = "--model" ]; then model="$2"; fi
if [ -z "$model" ]; then
  if [ -f ../shared/models/stories260K.gguf ]; then
    model=../shared/models/stories260K.gguf
  else
    model=build/models/synthetic-tiny.gguf
    if [ ! -f "$model" ]; then
      mkdir -p build/models
      echo "run.sh: no model configured: generating $model WITH RANDOM WEIGHTS (output is gibberish)" >&2
      build/bin/ds4-mkmodel --out "$model" --dim 64 --layers 2 --ff 172 --heads 8 --kv-heads 4 --type f32
    fi
  fi
fi
runtime="${XDG_RUNTIME_DIR:-/tmp}/ds4"
mkdir -p "$runtime"
exec build/bin/ds4-worker serve --model "$model" --socket "$runtime/worker-0.sock" --context 2048 --slots 2
