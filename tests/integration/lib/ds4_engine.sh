#!/usr/bin/env bash
# An OpenAI-compatible server made of ds4's own parts, for workers.engine: exec
# tests (there is no llama-server here): a native worker and the standalone
# ds4-proxy in front of it, in the foreground.
#   exec: command: "bash .../ds4_engine.sh {port} {ctx} {slots} {model}"
# The proxy replaces this shell (same pid, the one the supervisor's engine
# wrapper watches); the worker dies with it (pdeathsig).
set -eu
port=$1 ctx=$2 slots=$3 model=$4
bin=${DS4_BIN:?DS4_BIN must name the bin folder of a build}
sock=${DS4_ENGINE_DIR:-${TMPDIR:-/tmp}}/ds4-engine-$port.sock
rm -f "$sock"
setpriv --pdeathsig KILL "$bin/ds4-worker" serve --model "$model" --socket "$sock" --context "$ctx" \
  --slots "$slots" --threads 1 &
exec "$bin/ds4-proxy" --model "$model" --listen "127.0.0.1:$port" --worker-socket "$sock"
