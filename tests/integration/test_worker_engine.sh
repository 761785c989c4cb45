#!/usr/bin/env bash
# `ds4-worker engine` (workers.engine: exec) on its own: it ends the way its
# server ended — a server that fails before it answered is "does not fit"
# (75: the supervisor goes one rung down), one that cannot run is 127, one
# killed by a signal kills it with the same signal; SIGTERM is forwarded to
# the server; the server dies with the engine process; one that never answers HTTP is
# given up after --start-timeout.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
: "${DS4_BIN:?DS4_BIN must name the bin folder of a build}"
[[ -x $DS4_BIN/ds4-worker ]] || { echo "SKIP: no $DS4_BIN/ds4-worker"; exit 77; }
fails=0
pass() { echo "ok   - $*"; }
fail() { echo "FAIL - $*"; fails=$((fails + 1)); }
# gone PID: the process ended within 2 s (a zombie waiting for a reaper counts).
gone() {
  local i
  for i in $(seq 20); do
    [[ ! -e /proc/$1 || $(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) == Z ]] && return 0
    sleep 0.1
  done
  return 1
}
engine() { timeout 20 "$DS4_BIN/ds4-worker" engine --port 1 --start-timeout 10000 --command "$1" 2>/dev/null; }
# sleeper [STDERR]: ds4-worker engine over `sleep 300` in the background;
# sets wrapper (its pid) and server (the sleep's, once it runs).
sleeper() {
  "$DS4_BIN/ds4-worker" engine --port 1 --command "sleep 300 {port}" 2>"${1:-/dev/null}" &
  wrapper=$!
  server=
  for _ in $(seq 50); do server=$(pgrep -P $wrapper -x sleep) && break; sleep 0.1; done
}

engine "false {port}"
st=$?; ((st == 75)) && pass "a server that exits 1 before it answered: status 75 (does not fit)" || fail "false: status $st"
engine "/nonexistent/server --port {port}"
st=$?; ((st == 127)) && pass "a server that cannot run: status 127" || fail "nonexistent: status $st"

t0=$SECONDS
timeout 20 "$DS4_BIN/ds4-worker" engine --port 1 --start-timeout 500 --command "sleep 300 {port}" 2>/dev/null
st=$?; ((st == 1 && SECONDS - t0 < 10)) && pass "a server that never answers HTTP: status 1 after --start-timeout" \
  || fail "start timeout: status $st after $((SECONDS - t0)) s"

# sleep's arguments add up: "sleep 300 1" sleeps 301 s. It never answers HTTP.
sleeper
if [[ -n ${server:-} ]]; then
  kill -KILL "$server"
  wait $wrapper
  st=$?; ((st == 137)) && pass "a server SIGKILLed: the engine dies by SIGKILL too (137)" || fail "SIGKILL: status $st"
else fail "no server under the engine process"; kill $wrapper; fi

sleeper
kill -TERM $wrapper
wait $wrapper
st=$?
if ((st == 0)) && [[ -n $server ]] && gone "$server"; then pass "SIGTERM: forwarded, the server stopped, status 0"
else fail "SIGTERM: status $st, server ${server:-none} $(kill -0 "${server:-0}" 2>/dev/null && echo alive)"; fi

sleeper
kill -KILL $wrapper
wait $wrapper 2>/dev/null
if [[ -n $server ]] && gone "$server"; then pass "the server dies with a SIGKILLed engine process"
else fail "the server outlived the engine process: ${server:-none}"; kill -KILL "$server" 2>/dev/null; fi

# A fault in ds4-worker itself says where before it dies the same death
# (shared/crash_report.h): the signal and the call stack as frames that
# addr2line resolves, then the default action (status 128 + 11).
err=$(mktemp)
sleeper "$err"
kill -SEGV $wrapper
wait $wrapper
st=$?
frames=$(grep -c 'ds4-worker(+0x[0-9a-f]*)' "$err")
if ((st == 139)) && grep -q "ds4-worker: crashed: signal 11 (SEGV) sent by pid $$" "$err" && ((frames >= 3)); then
  pass "SIGSEGV: the call stack on stderr ($frames frames of ds4-worker), then status 139"
else
  fail "SIGSEGV: status $st, $frames frames, stderr: $(head -c 400 "$err")"
fi
[[ -n $server ]] && { gone "$server" || kill -KILL "$server" 2>/dev/null; }
rm -f "$err"

((fails)) && { echo "$fails failure(s)"; exit 1; }
echo "all passed"
