#!/usr/bin/env bash
# Hang detection, process backend: a worker stopped with SIGSTOP stops beating
# its heartbeat and answering; after restart.hang_timeout the supervisor logs
# DS4_EVENT=hang, SIGKILLs it, restarts it at the same context, and requests
# through the proxy are served again (lib/hang_check.sh). A worker that never
# becomes ready is killed after restart.start_timeout and started again.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"
. "$here/lib/hang_check.sh"

sup_begin curl
unset DBUS_SESSION_BUS_ADDRESS

hang_write_config process "$model"
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; tail -n 30 "$SUP_DIR/sup.log"; exit 1; }
[[ $(sup_get 's["backend"]') == process ]] && pass "process backend" || fail "backend $(sup_get 's["backend"]')"
hang_run
grep -q "worker 0 (pid $HANG_OLD_PID) exited: clean, killed by the supervisor (SIGKILL)" "$SUP_DIR/sup.log" \
  && pass "the exit is known as our own SIGKILL" || fail "exit of $HANG_OLD_PID not reported as our SIGKILL"

control=$(sup_get 's["control_block"]')
[[ -e /dev/shm${control} ]] && pass "control block /dev/shm$control exists" || fail "no /dev/shm$control"
sup_stop
[[ $SUP_RC == 0 ]] && pass "SIGTERM: clean exit" || fail "supervisor exit status $SUP_RC"
[[ ! -e /dev/shm${control} ]] && pass "control block removed on a clean stop" || fail "/dev/shm$control left behind"

# A worker that never becomes ready (here an exec engine that never answers:
# `sleep` sums its arguments) is hung at start: after restart.start_timeout it
# is killed and started again, and the second time in a row backs off. It
# used to stay "starting" for good under the process backend.
cat >"$SUP_DIR/start.yaml" <<YAML
model:
  path: $model
proxy:
  listen: 127.0.0.1:0
workers:
  backend: process
  engine: exec
  exec:
    command: sleep 600 {port}
  context:
    ladder: [256]
restart:
  start_timeout: 2s
  backoff_initial: 1s
YAML
: >"$SUP_DIR/sup.log"
sup_start "$SUP_DIR/start.yaml" || { fail "supervisor did not start"; tail -n 30 "$SUP_DIR/sup.log"; sup_finish; }
for _ in $(seq 150); do grep -q 'DS4_EVENT=backoff' "$SUP_DIR/sup.log" && break; sleep 0.1; done
hangs=$(grep -c 'hung at start; killing it, then starting it again at context 256' "$SUP_DIR/sup.log")
((hangs >= 2)) && grep -q 'not ready 2s after its start (restart.start_timeout)' "$SUP_DIR/sup.log" \
  && pass "a worker not ready 2s after its start: killed and started again ($hangs times)" \
  || fail "no start-timeout kill: $(grep -E 'DS4_EVENT=(hang|backoff|start)' "$SUP_DIR/sup.log" | tail -3)"
grep -q 'worker hung and was killed, 2 failures in a row; retrying in' "$SUP_DIR/sup.log" \
  && pass "the second one in a row backs off" || fail "no backoff after two start hangs"
sup_stop
[[ $SUP_RC == 0 ]] && pass "SIGTERM: clean exit" || fail "supervisor exit status $SUP_RC"
pgrep -f "sleep 600 " >/dev/null && fail "an engine outlived its worker: $(pgrep -af 'sleep 600 ')" || pass "no engine left behind"
sup_finish
