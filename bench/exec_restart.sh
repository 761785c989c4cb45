#!/usr/bin/env bash
# Restart-to-serving of an exec engine (the real llama-server, the peer)
# after a SIGKILL, once memory pressure has evicted the page cache, with
# model.keep_resident on and off, alternating in one run, on a ~1 GB model.
# Each fault: the worker process is frozen (SIGSTOP), llama-server SIGKILLed,
# the page cache dropped (echo 3 > /proc/sys/vm/drop_caches: needs root; it
# evicts every page not mapped and locked), then the worker thawed: it ends
# like its engine and the supervisor restarts it. Measured: from the thaw
# until a 1-token greedy completion through the proxy answers (the proxy
# queues it meanwhile), i.e. engine start + model load + first token.
#   bench/exec_restart.sh [ROUNDS=3] [KILLS=3]
# Ports 18780-18799 (DS4_BENCH_PORT_BASE).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3} kills=${2:-3}
bin=${DS4_BIN:-build/bin}
models=${DS4_MODELS:-../shared/models}
peer=${DS4_PEER:-../shared/peers/llama.cpp/bin}
base=${DS4_BENCH_PORT_BASE:-18780}
[[ -x $peer/llama-server ]] || { echo "no llama-server at $peer (DS4_PEER)" >&2; exit 1; }
[[ -w /proc/sys/vm/drop_caches ]] || { echo "cannot write /proc/sys/vm/drop_caches (root needed)" >&2; exit 1; }
mkdir -p build/models
big=build/models/1g-f16.gguf
[[ -f $big ]] || "$bin/ds4-mkmodel" --out "$big" --vocab-from "$models/stories260K.gguf" \
  --dim 2048 --layers 10 --ff 5632 --heads 16 --type f16 >&2
big=$(realpath "$big")
work=$(mktemp -d /tmp/ds4-exec-restart.XXXXXX)
export XDG_RUNTIME_DIR=$work/run DS4_EXEC_PORTS="$((base + 2))-$((base + 19))"
mkdir -p -m 0700 "$XDG_RUNTIME_DIR"
sup=
cleanup() { [[ -n $sup ]] && kill "$sup" 2>/dev/null && wait "$sup" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
now() { echo "${EPOCHREALTIME/[.,]/}"; }
status() { "$bin/ds4ctl" status --json 2>/dev/null; }
wait_ready() {
  for _ in $(seq 1200); do
    [[ $(status | jq -r '.workers[0].state') == ready ]] && return 0
    sleep 0.1
  done
  echo "the worker did not become ready" >&2; return 1
}
complete() { curl -s -o /dev/null -w '%{http_code}' --max-time 300 "http://127.0.0.1:$((base + 1))/v1/completions" \
  -d '{"prompt":"Once upon a time","max_tokens":1,"temperature":0}'; }
# measure runs in a subshell ($(measure ...)): its supervisor is stopped
# there, on every way out, since the EXIT trap above never sees its pid.
stop_sup() { [[ -n $sup ]] && kill "$sup" 2>/dev/null && wait "$sup" 2>/dev/null; sup=; }
measure() {  # MODE: prints the restart-to-serving times, ms
  cat >"$work/ds4.yaml" <<YAML
model:
  path: $big
  keep_resident: $1
proxy:
  listen: 127.0.0.1:$((base + 1))
workers:
  backend: process
  slots: 1
  context:
    ladder: [512]
  reserve: 64MiB
  engine: exec
  exec:
    command: "$peer/llama-server -m {model} --host 127.0.0.1 --port {port} -c {ctx} -np 1 -t 2 --no-webui"
headroom:
  min_available: 64MiB
  step_up_after: 0
YAML
  "$bin/ds4-supervisor" --config "$work/ds4.yaml" >>"$work/sup-$1.log" 2>&1 &
  sup=$!
  wait_ready || { stop_sup; return 1; }
  [[ $(complete) == 200 ]] || { echo "no answer before the faults" >&2; stop_sup; return 1; }
  if [[ $1 == on ]]; then  # the lock holds the whole file before the first fault
    for _ in $(seq 600); do [[ $(status | jq -r '.model.resident.mode') != loading ]] && break; sleep 0.1; done
  fi
  local k w e t0 t1 code
  for ((k = 0; k < kills; k++)); do
    wait_ready || { stop_sup; return 1; }
    w=$(status | jq -r '.workers[0].pid')
    e=$(pgrep -P "$w" -x llama-server)
    kill -STOP "$w"
    kill -9 "$e"
    while kill -0 "$e" 2>/dev/null && [[ $(ps -o stat= -p "$e") != Z* ]]; do sleep 0.01; done
    sync
    echo 3 >/proc/sys/vm/drop_caches
    t0=$(now)
    kill -CONT "$w"
    code=$(complete)
    t1=$(now)
    [[ $code == 200 ]] || { echo "HTTP $code after the fault" >&2; stop_sup; return 1; }
    echo -n "$(((t1 - t0) / 1000)) "
  done
  local resident
  resident=$(status | jq -c '.model.resident // "none"')
  stop_sup
  echo "(model.resident: $resident)"
}
echo "model $(basename "$big") $(du -h "$big" | cut -f1); $(nproc) cores; llama-server $("$peer/llama-server" --version 2>&1 | grep -m1 version)"
for ((r = 1; r <= rounds; r++)); do
  for mode in $( ((r % 2)) && echo "on off" || echo "off on"); do
    echo "round $r keep_resident $mode: restart-to-serving ms: $(measure $mode)"
  done
done
