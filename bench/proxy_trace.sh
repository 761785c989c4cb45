#!/usr/bin/env bash
# Where a request's time goes, stage by stage: the load of bench/proxy_overhead.sh
# (max_tokens 1, CONCURRENCY clients) against a supervisor started with DS4_TRACE
# (shared/request_trace.h), whose proxy and worker record each request's way by
# its id, and bench/http_load.c recording each send and answer; then
# bench/trace_report.py pairs them up and prints each stage's mean, p50 and p90.
# It shows, for instance, how long a request waits in a CUDA worker's socket while
# the worker launches a step (DS4_CUDA_STEP_READS; supervisor/proxy/NOTES.md).
# Environment: DS4_BIN (build/bin), DS4_MODELS (../shared/models), DS4_DEVICE (the
# worker's device: auto, cpu, cuda), DS4_BUSY_POLL and DS4_WORKER_BUSY_POLL (proxy.busy_poll and
# workers.busy_poll: auto, off, 100us), DS4_TRACE_DIR (keep the records there; else a
# temporary folder, removed), CC (cc). Extra arguments go to trace_report.py (--check N).
#   bench/proxy_trace.sh [CONCURRENCY=32] [REQUESTS=4000] [--check N]
set -euo pipefail
cd "$(dirname "$0")/.."
conc=${1:-32}
n=${2:-4000}
shift $(( $# < 2 ? $# : 2 ))
bin=${DS4_BIN:-build/bin}
model=${DS4_MODELS:-../shared/models}/stories260K.gguf
dir=$(mktemp -d /tmp/ds4-trace-XXXXXX)
out=${DS4_TRACE_DIR:-$dir}
mkdir -p "$out"
export XDG_RUNTIME_DIR=$dir/run
mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"
port=18185
cat >"$dir/ds4.yaml" <<YAML
model:
  path: $(realpath "$model")
  name: stories
proxy:
  listen: 127.0.0.1:$port
  busy_poll: ${DS4_BUSY_POLL:-auto}
workers:
  backend: process
  slots: 32
  device: ${DS4_DEVICE:-auto}
  busy_poll: ${DS4_WORKER_BUSY_POLL:-auto}
  threads: 1
  context:
    ladder: [512]
YAML
"${CC:-cc}" -O2 -pthread -o "$dir/http_load" bench/http_load.c
printf '%s' '{"model":"stories","prompt":"Once upon a time","max_tokens":1,"temperature":0}' >"$dir/body.json"
DS4_TRACE=$out/trace "$bin/ds4-supervisor" --config "$dir/ds4.yaml" >"$dir/sup.log" 2>&1 &
sup=$!
trap 'kill $sup 2>/dev/null || true; wait $sup 2>/dev/null || true; rm -rf "$dir"' EXIT
python3 bench/wait_healthy.py "$port" || { cat "$dir/sup.log" >&2; exit 1; }
"$dir/http_load" "$port" "$conc" "$((4 * conc))" "$dir/body.json" >/dev/null  # warm-up: traced, not reported
HTTP_LOAD_TRACE=1 "$dir/http_load" "$port" "$conc" "$n" "$dir/body.json" >"$out/client"
kill "$sup"
wait "$sup" || true
python3 bench/trace_report.py "$out/trace" "$out/client" "$@"
