#!/usr/bin/env bash
# Crash loop: a worker that cannot start (a device this build lacks) is
# retried at once, then with growing backoff capped at restart.backoff_max;
# status shows state backoff, degraded, and the worker's own error message.
# Then a fixed config (ds4ctl reload) brings it back. Process backend; the
# systemd test checks the same ends without start-limit-hit.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"

sup_begin
# ds4-worker has no CUDA backend in this build when --help says so; any
# device it refuses works as the crash.
"$DS4_BIN/ds4-worker" serve --help >/dev/null 2>&1
write_config() {
  cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $model
proxy:
  listen: 127.0.0.1:0         # any free port: tests run side by side
workers:
  backend: ${SUP_BACKEND:-process}
  device: $1
  threads: 1
  context:
    ladder: [512, 256]
restart:
  backoff_initial: 200ms
  backoff_max: 800ms
headroom:
  min_available: 16MiB
YAML
}
write_config cuda:7
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; exit 1; }

if sup_wait 20 'w[0]["state"] == "backoff" and w[0]["degraded"] and w[0]["failures"] >= 5'; then
  pass "state backoff, degraded after $(sup_get 'w[0]["failures"]') failures"
else
  fail "no backoff: $(sup_status | tr -d '\n' | cut -c1-500)"
fi
err=$(sup_get 'w[0]["last_error"]')
[[ $err == *cuda* || $err == *CUDA* ]] && pass "the worker's own error is shown: $err" || fail "last_error: '$err'"
# Backoff delays from the events: 200, 400, 800, 800 ms (capped).
delays=$(grep -o 'DS4_BACKOFF_MS=[0-9]*' "$SUP_DIR/sup.log" | cut -d= -f2 | head -5 | tr '\n' ' ')
[[ $delays == "200 400 800 800 "* ]] && pass "backoff grows and is capped: $delays" || fail "backoff delays: $delays"
"$DS4_BIN/ds4ctl" status | grep -q 'degraded:' && pass "ds4ctl status shows it degraded" || fail "ds4ctl status: no 'degraded' line"

write_config cpu
"$DS4_BIN/ds4ctl" reload >/dev/null || fail "ds4ctl reload"
if sup_wait 20 'w[0]["state"] == "ready"'; then pass "a fixed config brings the worker back"; else fail "not ready after the fix"; fi
sup_stop
[[ $SUP_RC == 0 ]] && pass "SIGTERM: clean exit" || fail "supervisor exit status $SUP_RC"
sup_finish 30
