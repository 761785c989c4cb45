#!/usr/bin/env bash
# Hang detection, process backend: a worker stopped with SIGSTOP stops beating
# its heartbeat and answering; after restart.hang_timeout the supervisor logs
# DS4_EVENT=hang, SIGKILLs it, restarts it at the same context, and requests
# through the proxy are served again (lib/hang_check.sh).
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"
. "$here/lib/hang_check.sh"

model=${DS4_MODELS:-$DS4_SRC/../shared/models}/stories260K.gguf
[[ -f $model ]] || { echo "SKIP: no $model"; exit 77; }
command -v curl >/dev/null || { echo "SKIP: no curl"; exit 77; }
sup_init || exit $?
trap sup_cleanup EXIT
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
sup_finish
