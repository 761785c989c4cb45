# Helpers for the proxy tests: a temp folder, real workers on stories260K,
# a standalone ds4-proxy, cleanup of everything started. Source it, then call
# proxy_env_init (exits 77 with the reason when something is missing).
#   start_worker N [context] [slots]   worker N on $T/wN.sock (pid in $T/wN.pid)
#   start_proxy CONFIG SOCKETS...      sets PROXY_URL (pid in $T/proxy.pid)
#   metric NAME                        a value from /metrics
set -u

proxy_env_init() {
  BIN=${DS4_BIN:-}
  SRC=${DS4_SRC:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)}
  MODELS=${DS4_MODELS:-$SRC/../shared/models}
  MODEL=$MODELS/stories260K.gguf
  [ -n "$BIN" ] && [ -x "$BIN/ds4-proxy" ] && [ -x "$BIN/ds4-worker" ] || { echo "SKIP: DS4_BIN has no ds4-proxy/ds4-worker"; exit 77; }
  [ -f "$MODEL" ] || { echo "SKIP: no model at $MODEL"; exit 77; }
  command -v curl >/dev/null || { echo "SKIP: no curl"; exit 77; }
  command -v jq >/dev/null || { echo "SKIP: no jq"; exit 77; }
  T=$(mktemp -d /tmp/ds4-proxy-test.XXXXXX)
  PIDS=()
  trap proxy_env_cleanup EXIT
  fails=0
}

proxy_env_cleanup() {
  for f in "$T"/*.pid; do [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null; done
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
  [ "${KEEP_TMP:-0}" = 1 ] || rm -rf "$T"
}

pass() { echo "ok   - $*"; }
fail() { echo "FAIL - $*"; fails=$((fails + 1)); }
check() { local what=$1; shift; if "$@"; then pass "$what"; else fail "$what"; fi; }

start_worker() {
  local n=$1 ctx=${2:-256} slots=${3:-2}
  "$BIN/ds4-worker" serve --model "$MODEL" --socket "$T/w$n.sock" --id "$n" --context "$ctx" --slots "$slots" \
    --threads 1 >>"$T/w$n.log" 2>&1 &
  echo $! >"$T/w$n.pid"
  disown $!
}

# Waits (bounded) until worker N answers on its socket.
wait_worker() {
  local n=$1
  for _ in $(seq 100); do
    [ -S "$T/w$n.sock" ] && grep -q "serving" "$T/w$n.log" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "worker $n did not start:"; cat "$T/w$n.log"; return 1
}

start_proxy() {
  local cfg=$1; shift
  local args=()
  for s in "$@"; do args+=(--worker-socket "$s"); done
  "$BIN/ds4-proxy" --config "$cfg" --model "$MODEL" "${args[@]}" >"$T/proxy.out" 2>"$T/proxy.err" &
  echo $! >"$T/proxy.pid"
  disown $!
  for _ in $(seq 100); do
    if grep -q "^listening on" "$T/proxy.out"; then
      PROXY_URL="http://$(sed -n 's/^listening on //p' "$T/proxy.out")"
      return 0
    fi
    sleep 0.1
  done
  echo "the proxy did not start:"; cat "$T/proxy.err"; return 1
}

stop_proxy() {
  [ -f "$T/proxy.pid" ] && kill -9 "$(cat "$T/proxy.pid")" 2>/dev/null
  rm -f "$T/proxy.pid"
}

metric() { curl -s --max-time 5 "$PROXY_URL/metrics" | awk -v n="$1" '$1 == n { print $2 }'; }

# Waits (bounded, ~10 s) until metric NAME equals VALUE.
wait_metric() {
  for _ in $(seq 100); do [ "$(metric "$1")" = "$2" ] && return 0; sleep 0.1; done
  return 1
}

js_ready() { [ -d "$SRC/tests/js/node_modules/openai" ] && [ -d "$SRC/tests/js/node_modules/@anthropic-ai/sdk" ] && command -v node >/dev/null; }
