# shellcheck shell=bash
# Helpers for tests that run ds4-supervisor and query it with ds4ctl.
#
#   . "$DS4_SRC/tests/integration/lib/supervisor_env.sh"
#   sup_begin [COMMAND...]              # a test on stories260K: sets $model, skips
#                                       # without it or a COMMAND, sup_init, cleanup on exit
#   sup_init || exit $?                 # checks DS4_BIN etc.; makes $SUP_DIR
#   sup_install_begin [COMMAND...]      # the same for a test of the installed units
#                                       # (with lib/systemd_env.sh): sets $build too
#   sup_wait_health URL [TRIES]         # GET URL/health until 200; $code = the last answer
#   sup_health URL, sup_free_port       # one GET /health's code; a free local port
#   sup_start CONFIG_FILE               # starts it (log: $SUP_DIR/sup.log)
#   sup_wait 30 'w[0]["state"] == "ready"'   # a Python expression on status:
#                                       #   s = the status JSON, w = s["workers"]
#   sup_stop                            # SIGTERM, bounded wait
#   sup_synthetic_model FILE ARGS...    # ds4-mkmodel FILE (skips the test when it cannot)
#   SUP_SEGMENTS+=(NAME)                # a model segment sup_cleanup removes from /dev/shm
# Every wait is bounded. Requires python3 (for JSON).

sup_log() { echo "[supervisor_env] $*" >&2; }

sup_init() {
  : "${DS4_BIN:?DS4_BIN must name the bin folder of a build}"
  : "${DS4_SRC:?DS4_SRC must name the source folder}"
  : "${DS4_MODELS:=$DS4_SRC/../shared/models}"
  for b in ds4-supervisor ds4ctl ds4-worker; do
    [[ -x $DS4_BIN/$b ]] || { echo "SKIP: no $DS4_BIN/$b (build first)"; return 77; }
  done
  command -v python3 >/dev/null || { echo "SKIP: python3 is needed to read JSON"; return 77; }
  SUP_DIR=$(mktemp -d /tmp/ds4-sup-test.XXXXXX) || return 1
  SUP_PID=
  SUP_SEGMENTS=()
  # A private runtime dir unless the caller (systemd harness) set one.
  if [[ -z ${XDG_RUNTIME_DIR:-} || ${SUP_PRIVATE_RUNTIME:-1} == 1 ]]; then
    export XDG_RUNTIME_DIR=$SUP_DIR/run
    mkdir -p -m 0700 "$XDG_RUNTIME_DIR"
  fi
  export SUP_DIR
}

# sup_begin [COMMAND...]: how a test on stories260K begins. Sets $model to
# the file; the test is skipped (exit 77, the reason printed) without it,
# without one of the COMMANDs, or where sup_init finds something missing;
# then $SUP_DIR exists and sup_cleanup runs on exit.
sup_begin() {
  : "${DS4_SRC:?DS4_SRC must name the source folder}"
  model=${DS4_MODELS:-$DS4_SRC/../shared/models}/stories260K.gguf
  [[ -f $model ]] || { echo "SKIP: no $model"; exit 77; }
  local c
  for c in "$@"; do command -v "$c" >/dev/null || { echo "SKIP: no $c"; exit 77; }; done
  sup_init || exit $?
  trap sup_cleanup EXIT
}

# sup_install_begin [COMMAND...]: how a test of the installed service begins
# (cmake --install of $DS4_BIN's build under a fresh user manager; the test
# sources lib/systemd_env.sh too). Sets $model (stories260K) and $build,
# skips (77) when the model, curl, cmake, a named command or the CMake build
# folder is missing, starts the user manager and sup_init, and on exit
# disables the installed units, cleans up and stops the manager.
sup_install_begin() {
  : "${DS4_BIN:?DS4_BIN must name the bin folder of a build}"
  model=${DS4_MODELS:-${DS4_SRC:-}/../shared/models}/stories260K.gguf
  [[ -f $model ]] || { echo "SKIP: no $model"; exit 77; }
  local c
  for c in curl cmake "$@"; do command -v "$c" >/dev/null || { echo "SKIP: no $c"; exit 77; }; done
  build=$(cd "$DS4_BIN/.." && pwd)
  [[ -f $build/cmake_install.cmake ]] || { echo "SKIP: $build is not a CMake build folder"; exit 77; }
  ds4_systemd_start || exit $?
  SUP_PRIVATE_RUNTIME=0 sup_init || { ds4_systemd_stop; exit 77; }
  trap sup_install_cleanup EXIT
}
sup_install_cleanup() {
  timeout 60 systemctl --user disable --now ds4-supervisor.service ds4-supervisor.socket >/dev/null 2>&1
  sup_cleanup
  ds4_systemd_stop
}

# sup_health URL [MAX_TIME]: the status code of GET URL/health (000 when
# nothing answers). sup_wait_health URL [TRIES] [MAX_TIME]: asks every 0.1 s
# until it is 200, at most TRIES (300) times; $code holds the last answer;
# returns 0 on 200.
sup_health() { curl -s -o /dev/null -w '%{http_code}' --max-time "${2:-5}" "$1/health"; }
sup_wait_health() {
  local i
  for ((i = 0; i < ${2:-300}; i++)); do
    code=$(sup_health "$1" "${3:-5}")
    [[ $code == 200 ]] && return 0
    sleep 0.1
  done
  return 1
}
# sup_free_port: a TCP port on 127.0.0.1 that nothing listens on now.
sup_free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

sup_start() {
  local config=$1
  "$DS4_BIN/ds4-supervisor" --config "$config" >>"$SUP_DIR/sup.log" 2>&1 &
  SUP_PID=$!
  if ! sup_wait 60 'True'; then
    sup_log "the supervisor did not answer within 60 s; its log:"
    tail -n 30 "$SUP_DIR/sup.log" >&2
    return 1
  fi
}

# Check lines: pass TEXT / fail TEXT, counted; sup_finish [LINES] ends the
# test: on failures the count and the supervisor log's last LINES (40), the
# test folder kept, exit 1; else "all passed".
fails=0
pass() { echo "ok   - $*"; }
fail() { echo "FAIL - $*"; fails=$((fails + 1)); }
sup_finish() {
  if ((fails)); then
    echo "$fails failure(s)"
    tail -n "${1:-40}" "$SUP_DIR/sup.log"
    SUP_KEEP=1
    exit 1
  fi
  echo "all passed"
}

# sup_status: the status JSON on stdout.
sup_status() { "$DS4_BIN/ds4ctl" status --json 2>/dev/null; }

# sup_check EXPR: true when EXPR holds on the current status.
sup_check() {
  local json
  json=$(sup_status) || return 1
  python3 -c '
import json, sys
s = json.loads(sys.argv[1]); w = s["workers"]
sys.exit(0 if eval(sys.argv[2]) else 1)' "$json" "$1" 2>/dev/null
}

# sup_get EXPR: prints EXPR evaluated on the current status.
sup_get() {
  local json
  json=$(sup_status) || return 1
  python3 -c '
import json, sys
s = json.loads(sys.argv[1]); w = s["workers"]
print(eval(sys.argv[2]))' "$json" "$1"
}

# sup_events: the events as JSON ({"ok":true,"events":[...]}).
sup_events() { "$DS4_BIN/ds4ctl" events --json 2>/dev/null; }

# sup_proxy_url: the proxy's address, from the supervisor's log line.
sup_proxy_url() {
  local addr
  addr=$(sed -n 's/.*proxy listening on \([0-9.]*:[0-9]*\).*/\1/p' "$SUP_DIR/sup.log" | tail -1)
  [[ -n $addr ]] && echo "http://$addr"
}

# sup_complete URL MODEL: one greedy /v1/completions request; prints the body,
# then the HTTP status on a line of its own.
sup_complete() {
  curl -s --max-time 30 -w '\n%{http_code}' "$1/v1/completions" -H 'content-type: application/json' \
    -d '{"model":"'"$2"'","prompt":"Once upon a time","max_tokens":8,"temperature":0}'
}

# sup_health_poll_start URL: polls URL/health every 20 ms in the background
# until sup_health_poll_stop (at most 180 s). sup_health_poll_stop then sets
# POLLS (how many), POLL_BAD (how many got no answer; any status is an
# answer: /health says 503 while a worker restarts), POLL_OK (how many said
# 200) and POLL_SLOWEST (the slowest answer, ms).
sup_health_poll_start() {
  rm -f "$SUP_DIR/poll.stop"
  python3 - "$1/health" "$SUP_DIR/poll.stop" >"$SUP_DIR/poll.out" 2>&1 <<'PY' &
import os, sys, time, urllib.request, urllib.error
url, stop = sys.argv[1], sys.argv[2]
n = bad = ok = 0
slowest = 0.0
deadline = time.monotonic() + 180
while not os.path.exists(stop) and time.monotonic() < deadline:
    t = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            r.read()
            ok += r.status == 200
    except urllib.error.HTTPError as e:
        e.read()
    except Exception:
        bad += 1
    slowest = max(slowest, time.monotonic() - t)
    n += 1
    time.sleep(0.02)
print(n, bad, ok, int(slowest * 1000))
PY
  SUP_POLLER=$!
  sleep 0.5
}
sup_health_poll_stop() {
  touch "$SUP_DIR/poll.stop"
  wait "$SUP_POLLER"
  read -r POLLS POLL_BAD POLL_OK POLL_SLOWEST <"$SUP_DIR/poll.out"
}

# sup_wait SECONDS EXPR
sup_wait() {
  local timeout=$1 expr=$2 now deadline
  now=${EPOCHREALTIME/[.,]/}
  deadline=$((now + timeout * 1000000))
  while true; do
    sup_check "$expr" && return 0
    if [[ -n $SUP_PID ]] && ! kill -0 "$SUP_PID" 2>/dev/null; then
      sup_log "the supervisor exited"
      return 1
    fi
    now=${EPOCHREALTIME/[.,]/}
    ((now >= deadline)) && return 1
    sleep 0.1
  done
}

sup_stop() {
  [[ -n ${SUP_PID:-} ]] || return 0
  if kill -0 "$SUP_PID" 2>/dev/null; then
    kill -TERM "$SUP_PID"
    local i
    for i in $(seq 150); do kill -0 "$SUP_PID" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$SUP_PID" 2>/dev/null; then
      sup_log "supervisor $SUP_PID did not stop within 15 s; killing it"
      kill -KILL "$SUP_PID"
    fi
  fi
  wait "$SUP_PID" 2>/dev/null
  SUP_RC=$?
  SUP_PID=
}

sup_cleanup() {
  sup_stop
  local s
  for s in "${SUP_SEGMENTS[@]:-}"; do [[ -n $s ]] && rm -f "/dev/shm/$s"; done
  # The model segments this test's supervisor served (its runtime folder's
  # ledger): no later sweep knows them once that folder is gone, so they go
  # now, unless a process still maps one (a test running beside this one).
  local ledger=${XDG_RUNTIME_DIR:-}/ds4/segments.list
  if [[ -n ${SUP_DIR:-} && $ledger == "$SUP_DIR"/* && -f $ledger && ${SUP_KEEP:-0} != 1 ]]; then
    while read -r s; do
      [[ $s =~ ^ds4-model-[0-9a-f]+$ && -f /dev/shm/$s ]] || continue
      grep -qs "/dev/shm/$s" /proc/[0-9]*/maps || rm -f "/dev/shm/$s"
    done <"$ledger"
  fi
  [[ -n ${SUP_DIR:-} && ${SUP_KEEP:-0} != 1 ]] && rm -rf "$SUP_DIR"
}

# sup_synthetic_model FILE ARGS...: a synthetic model with stories260K's
# vocabulary (ds4-mkmodel --preset, --type, ...) written to FILE; the test is
# skipped (exit 77, reason printed) when that cannot be done here.
sup_synthetic_model() {
  local out=$1 vocab=$DS4_MODELS/stories260K.gguf
  shift
  [[ -f $vocab ]] || { echo "SKIP: no $vocab"; exit 77; }
  [[ -x $DS4_BIN/ds4-mkmodel ]] || { echo "SKIP: no $DS4_BIN/ds4-mkmodel"; exit 77; }
  "$DS4_BIN/ds4-mkmodel" --out "$out" --vocab-from "$vocab" "$@" >/dev/null 2>&1 \
    || { echo "SKIP: ds4-mkmodel could not write $out (disk space?)"; exit 77; }
}

# A cgroup-v1 memory cgroup of the test's own (root), under which the
# supervisor puts its workers' cgroups (DS4_WORKER_CGROUP_PARENT), for a real
# OOM kill. Then sup_init; on EXIT, sup_cleanup and the cgroups go.
# Sets SUP_CGROUP. Exits 77 with the reason where it cannot be made.
sup_init_memory_cgroup() {
  local name=$1
  ((EUID == 0)) || { echo "SKIP: making a memory cgroup needs root"; exit 77; }
  local own
  own=$(sed -n 's/^[0-9]*:memory:\(.*\)$/\1/p' /proc/self/cgroup)
  if [[ -z $own || ! -d /sys/fs/cgroup/memory$own ]]; then
    echo "SKIP: no cgroup-v1 memory hierarchy here (cgroup v2 needs a delegated subtree; the systemd test covers it)"
    exit 77
  fi
  SUP_CGROUP=/sys/fs/cgroup/memory${own%/}/$name-$$
  mkdir "$SUP_CGROUP" 2>/dev/null || { echo "SKIP: cannot create memory cgroup $SUP_CGROUP"; exit 77; }
  sup_init || { rmdir "$SUP_CGROUP"; exit 77; }
  trap sup_cleanup_memory_cgroup EXIT
  export DS4_WORKER_CGROUP_PARENT=$SUP_CGROUP
}

sup_cleanup_memory_cgroup() {
  sup_cleanup
  # Worker cgroups (ds4-worker-N) are removed by the supervisor; then ours.
  local d
  for d in "$SUP_CGROUP"/ds4-worker-*; do [[ -d $d ]] && rmdir "$d" 2>/dev/null; done
  rmdir "$SUP_CGROUP" 2>/dev/null || echo "note - could not remove $SUP_CGROUP"
}

