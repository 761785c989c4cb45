#!/usr/bin/env bash
# An OpenAI-compatible server made of ds4's own parts, for workers.engine: exec
# tests (there is no llama-server here): a native worker and the standalone
# ds4-proxy in front of it.
#   exec: command: "bash .../ds4_engine.sh {port} {ctx} {slots} {model}"
# It behaves as one server would: when either part ends, the other is stopped
# and this script ends the same way (the same signal: an OOM kill of the
# worker reads as a SIGKILL of the server). SIGTERM stops both.
set -u
port=$1 ctx=$2 slots=$3 model=$4
bin=${DS4_BIN:?DS4_BIN must name the bin folder of a build}
sock=${DS4_ENGINE_DIR:-${TMPDIR:-/tmp}}/ds4-engine-$port.sock
rm -f "$sock"
setpriv --pdeathsig KILL "$bin/ds4-worker" serve --model "$model" --socket "$sock" --context "$ctx" \
  --slots "$slots" --threads 1 &
worker=$!
setpriv --pdeathsig KILL "$bin/ds4-proxy" --model "$model" --listen "127.0.0.1:$port" --worker-socket "$sock" &
proxy=$!
trap 'kill -TERM $proxy $worker 2>/dev/null; wait; exit 0' TERM INT
wait -n
status=$?
kill -KILL $worker $proxy 2>/dev/null
wait
rm -f "$sock"
if ((status > 128)); then
  trap - TERM INT
  kill -s "$((status - 128))" $$
fi
exit "$status"
