# shellcheck shell=bash
# A worker that hangs for real, for test_supervisor_hang*.sh: SIGSTOP its
# process (a stopped process neither beats its heartbeat nor answers on its
# socket) and check what a user would: the supervisor logs DS4_EVENT=hang
# naming the worker, kills it, restarts it at the same context, status shows
# the new pid ready, and a request through the proxy is served afterwards.
#
#   . lib/supervisor_env.sh; . lib/hang_check.sh
#   hang_write_config BACKEND MODEL     # $SUP_DIR/ds4.yaml, hang_timeout 2s
#   sup_start "$SUP_DIR/ds4.yaml"
#   hang_run                            # pass/fail lines; uses pass() and fail()
# Sets HANG_OLD_PID and HANG_NEW_PID.

HANG_TIMEOUT_MS=2000

hang_write_config() {  # BACKEND MODEL
  cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $2
proxy:
  listen: 127.0.0.1:0         # any free port: tests run side by side
workers:
  backend: $1
  device: cpu
  slots: 2
  threads: 1
  context:
    ladder: [512, 256]
  reserve: 64MiB
headroom:
  min_available: 64MiB
  step_up_after: 0
restart:
  hang_timeout: ${HANG_TIMEOUT_MS}ms   # short, for the test; the default is 30s
YAML
}

hang_run() {
  if ! sup_wait 60 'w[0]["state"] == "ready"'; then
    fail "worker not ready: $(sup_status | tr -d '\n' | cut -c1-400)"
    return 1
  fi
  local url out ctx t0 t1 line
  url=$(sup_proxy_url)
  [[ -n $url ]] || { fail "no 'proxy listening on' line in the log"; return 1; }
  ctx=$(sup_get 'w[0]["context"]')
  HANG_MODEL=$(sup_get 's["model"]["name"]')
  HANG_OLD_PID=$(sup_get 'w[0]["pid"]')
  out=$(sup_complete "$url" "$HANG_MODEL")
  [[ ${out##*$'\n'} == 200 ]] && pass "served before the hang" || fail "request before the hang: $out"
  # The control block: a fresh heartbeat and the request counted.
  if sup_wait 5 'w[0]["heartbeat_age_ms"] is not None and w[0]["heartbeat_age_ms"] < 1000 and w[0]["counters"]["requests"] >= 1'; then
    pass "control block: heartbeat $(sup_get 'w[0]["heartbeat_age_ms"]') ms old, counters $(sup_get 'w[0]["counters"]')"
  else
    fail "control block figures: $(sup_get 'w[0].get("heartbeat_age_ms")') / $(sup_get 'w[0].get("counters")')"
  fi
  "$DS4_BIN/ds4ctl" status | grep -Eq "^0 .* [0-9.]+s ago( |$)" && pass "ds4ctl status shows the heartbeat age" \
    || fail "ds4ctl status has no heartbeat age: $("$DS4_BIN/ds4ctl" status | sed -n '/^ID/,$p' | head -3)"

  kill -STOP "$HANG_OLD_PID"
  t0=${EPOCHREALTIME/[.,]/}
  if sup_wait 30 'w[0]["state"] == "ready" and w[0]["pid"] not in (0, '"$HANG_OLD_PID"')'; then
    t1=${EPOCHREALTIME/[.,]/}
    HANG_NEW_PID=$(sup_get 'w[0]["pid"]')
    pass "hung worker replaced: pid $HANG_OLD_PID -> $HANG_NEW_PID, ready $(((t1 - t0) / 1000)) ms after SIGSTOP (hang_timeout ${HANG_TIMEOUT_MS} ms)"
  else
    fail "the stopped worker was not replaced: $(sup_status | tr -d '\n' | cut -c1-500)"
    kill -CONT "$HANG_OLD_PID" 2>/dev/null
    return 1
  fi
  line=$(grep -m1 'DS4_EVENT=hang' "$SUP_DIR/sup.log")
  [[ $line == *"worker 0: hang at $ctx"*"DS4_WORKER=0"* && $line == *"DS4_PID=$HANG_OLD_PID"* ]] \
    && pass "hang event: ${line:0:220}" || fail "no DS4_EVENT=hang entry naming worker 0 and pid $HANG_OLD_PID: '$line'"
  [[ $(grep -c 'DS4_EVENT=hang' "$SUP_DIR/sup.log") == 1 ]] && pass "one hang event" \
    || fail "$(grep -c 'DS4_EVENT=hang' "$SUP_DIR/sup.log") hang events"
  sup_events | grep -q '"event": "hang"' && pass "ds4ctl events lists the hang" || fail "ds4ctl events: no hang"
  ! kill -0 "$HANG_OLD_PID" 2>/dev/null && pass "the hung process $HANG_OLD_PID is gone (killed)" \
    || fail "process $HANG_OLD_PID still exists"
  [[ $(sup_get 'w[0]["context"]') == "$ctx" ]] && pass "restarted at the same context $ctx" \
    || fail "context $(sup_get 'w[0]["context"]'), was $ctx"
  [[ $(sup_get 'w[0]["oom_kills"]') == 0 && $(sup_get 'w[0]["restarts"]') == 1 ]] \
    && pass "status: restarts 1, oom_kills 0" || fail "restarts $(sup_get 'w[0]["restarts"]'), oom_kills $(sup_get 'w[0]["oom_kills"]')"
  [[ $(sup_get '" ".join(w[0]["args"])') == *"--context $ctx"* ]] && pass "the new process runs --context $ctx (/proc)" \
    || fail "args: $(sup_get 'w[0]["args"]')"
  out=$(sup_complete "$url" "$HANG_MODEL")
  [[ ${out##*$'\n'} == 200 && $out == *'"text"'* ]] && pass "served after the restart: $(echo "$out" | head -1 | cut -c1-120)" \
    || fail "request after the restart: $out"
}
