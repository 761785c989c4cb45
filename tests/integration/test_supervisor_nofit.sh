#!/usr/bin/env bash
# A worker whose memory plan does not fit (the GPU's free memory on a GPU
# machine, the host's here) exits with its own status, and the supervisor
# restarts it one rung lower at once: a downgrade, not a crash or a backoff.
# Process backend, real worker: the ladder's top rung (16M positions x 64
# slots) cannot fit any machine's memory. The supervisor starts at the rung
# that fits; an administrator then asks for the top rung (ds4ctl context);
# the worker refuses it with its plan's figures and the supervisor goes back
# down, and requests are answered again. DS4_NOFIT_DEVICE=cuda:0 runs it on a
# GPU, where the worker checks the device's free memory instead.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"

sup_begin
top=16777216
cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $model
proxy:
  listen: 127.0.0.1:0         # any free port: tests run side by side
workers:
  backend: process
  device: ${DS4_NOFIT_DEVICE:-cpu}
  slots: 64
  threads: 1
  context:
    ladder: [$top, 256]
restart:
  backoff_initial: 200ms
  backoff_max: 800ms
headroom:
  min_available: 16MiB
  step_up_after: 0
YAML
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; exit 1; }
if sup_wait 30 'w[0]["state"] == "ready" and w[0]["context"] == 256'; then
  pass "started at the rung that fits: context 256"
else
  fail "not ready at 256: $(sup_status | tr -d '\n' | cut -c1-400)"; exit 1
fi
url=$(sup_proxy_url)
model_name=$(sup_get 's["model"]["name"]')
pid=$(sup_get 'w[0]["pid"]')

t0=${EPOCHREALTIME/[.,]/}
"$DS4_BIN/ds4ctl" context 0 $top >/dev/null || fail "ds4ctl context 0 $top"
if sup_wait 30 'w[0]["state"] == "ready" and w[0]["pid"] not in (0, '"$pid"') and w[0]["restarts"] >= 2'; then
  t1=${EPOCHREALTIME/[.,]/}
  pass "ready again after the refused rung ($(((t1 - t0) / 1000)) ms from the request)"
else
  fail "not ready again: $(sup_status | tr -d '\n' | cut -c1-600)"
fi
[[ $(sup_get 'w[0]["context"]') == 256 ]] && pass "back at context 256" || fail "context $(sup_get 'w[0]["context"]')"
exit_kind=$(sup_get 'w[0]["last_exit"]')
[[ $exit_kind == does_not_fit* ]] && pass "last_exit: ${exit_kind:0:100}..." || fail "last_exit: $exit_kind"
err=$(sup_get 'w[0]["last_error"]')
[[ $err == *"memory plan does not fit"*"context $top x 64 slots"* ]] && pass "the worker's own figures: ${err:0:160}..." \
  || fail "last_error: $err"
[[ $(sup_get 'w[0]["failures"]') == 0 && $(sup_get 'w[0]["oom_kills"]') == 0 ]] \
  && pass "not a failure, not an OOM kill" || fail "failures $(sup_get 'w[0]["failures"]'), oom_kills $(sup_get 'w[0]["oom_kills"]')"
ev=$(sup_events | python3 -c '
import json, sys
for e in json.load(sys.stdin)["events"]:
    if e["event"] == "downgrade" and "did not fit" in e["reason"]:
        print(e["context_from"], e["context_to"], e["reason"][:200]); break')
[[ $ev == "$top 256 "* ]] && pass "event: downgrade $ev" || fail "no downgrade event for the refused rung: $ev"
sup_events | grep -q '"event":"backoff"' && fail "a backoff event: $(sup_events | head -c 600)" || pass "no backoff"
out=$(sup_complete "$url" "$model_name")
[[ ${out##*$'\n'} == 200 ]] && pass "a request is answered (200)" || fail "request: $out"
sup_stop
[[ $SUP_RC == 0 ]] && pass "SIGTERM: clean exit" || fail "supervisor exit status $SUP_RC"
sup_finish 30
