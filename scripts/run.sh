#!/usr/bin/env bash
# Sets up and runs the whole ds4 service in the foreground: the supervisor
# (model store, workers, proxy on 127.0.0.1:8080) with the embedded defaults.
#   scripts/run.sh [CONFIG]
# Without CONFIG it serves ../shared/models/stories260K.gguf when that file is
# there, else config/ds4.yaml as shipped (no model configured: a small
# synthetic model with random weights, said loudly in the log).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
config=${1:-}
if [ -z "$config" ]; then
  config=config/ds4.yaml
  if [ -f ../shared/models/stories260K.gguf ]; then
    config=build/run.yaml
    { echo "model:"; echo "  path: $(realpath ../shared/models/stories260K.gguf)"; echo "  name: stories"; } > "$config"
  fi
fi
echo "run.sh: ds4-supervisor --config $config (OpenAI and Anthropic APIs on http://127.0.0.1:8080)" >&2
exec build/bin/ds4-supervisor --config "$config"
