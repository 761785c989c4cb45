#!/usr/bin/env bash
# The systemd backend against a real user manager and journal (the harness in
# lib/systemd_env.sh): workers run as ds4-worker@N.service units that the
# supervisor drives over sd-bus, with a unit template it writes itself.
#   1. OOM ladder [2048, 256] on stories260K: 256 slots x 2048 cannot fit
#      MemoryMax=150MiB; the kernel OOM-kills the worker for real; the
#      supervisor logs the OOM event naming the unit and restarts at 256;
#      status shows context 256, one OOM kill and the restart. Prints the
#      time from the OOM kill to ready again.
#   2. A person's SIGKILL is a restart at the same context, not an OOM kill.
#   3. Supervisor SIGKILL + restart: the worker keeps its pid, the segment is
#      reused, status is right.
#   4. Crash loop: backoff, degraded, the worker's error, no start-limit-hit.
# Measuring another model: DS4_OOM_MODEL=FILE DS4_OOM_SLOTS=N DS4_OOM_MEMORY_MAX=SIZE
# (slots and limit such that context 2048 cannot fit and 256 can).
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/systemd_env.sh"
. "$here/lib/supervisor_env.sh"

model=${DS4_OOM_MODEL:-${DS4_MODELS:-${DS4_SRC:-}/../shared/models}/stories260K.gguf}
[[ -f $model ]] || { echo "SKIP: no $model"; exit 77; }
ds4_systemd_start || exit $?
SUP_PRIVATE_RUNTIME=0 sup_init || { ds4_systemd_stop; exit 77; }
cleanup() { sup_cleanup; ds4_systemd_stop; }
trap cleanup EXIT
unit=ds4-worker@0.service
cursor=$(journalctl --show-cursor -n 0 -q 2>/dev/null | sed -n 's/^-- cursor: //p')
after=(--cursor "$cursor" --no-pager -q)

write_config() {  # DEVICE
  cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $model
proxy:
  listen: 127.0.0.1:0         # any free port: tests run side by side
workers:
  backend: systemd
  device: $1
  slots: ${DS4_OOM_SLOTS:-256}
  threads: 1
  busy_poll: 50us            # reaches the unit's process through its environment file
  context:
    ladder: [2048, 256]      # x 256 slots: 320 MiB of KV at 2048, 40 MiB at 256
  memory_max: ${DS4_OOM_MEMORY_MAX:-150MiB}
  reserve: 64MiB
headroom:
  min_available: 64MiB
  step_up_after: 0
restart:
  backoff_initial: 200ms
  backoff_max: 800ms
YAML
}
write_config cpu

# --- 1. OOM ladder ---
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; exit 1; }
[[ $(sup_get 's["backend"]') == systemd ]] && pass "systemd backend in use" || fail "backend: $(sup_get 's["backend"]')"
if sup_wait 60 'w[0]["state"] == "ready" and w[0]["context"] == 256'; then
  pass "worker ready at context 256 after the OOM kill"
else
  fail "worker not ready at 256: $(sup_status | tr -d '\n' | cut -c1-600)"
fi
[[ -f $XDG_RUNTIME_DIR/systemd/user/ds4-worker@.service ]] && pass "the supervisor wrote the unit template" \
  || fail "no template under \$XDG_RUNTIME_DIR/systemd/user"
[[ $(sup_get 'w[0]["unit"]') == "$unit" ]] && pass "status names $unit" || fail "unit: $(sup_get 'w[0]["unit"]')"
[[ $(sup_get 'w[0]["oom_kills"]') == 1 ]] && pass "status: oom_kills 1" || fail "status: oom_kills $(sup_get 'w[0]["oom_kills"]')"
[[ $(sup_get 'w[0]["restarts"]') == 1 ]] && pass "status: restarts 1" || fail "status: restarts $(sup_get 'w[0]["restarts"]')"
pid=$(sup_get 'w[0]["pid"]')
[[ $pid == $(systemctl --user show -P MainPID $unit) ]] && pass "status pid $pid is the unit's MainPID" || fail "pid $pid vs MainPID $(systemctl --user show -P MainPID $unit)"
tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx 'DS4_BUSY_POLL_US=50' \
  && pass "workers.busy_poll 50us reaches the unit's process (DS4_BUSY_POLL_US=50)" \
  || fail "no DS4_BUSY_POLL_US=50 in the worker's environment"
[[ $(sup_get '" ".join(w[0]["args"])') == *"--context 256"* ]] && pass "the unit's process runs --context 256 (/proc)" || fail "args: $(sup_get 'w[0]["args"]')"
dropin=$XDG_RUNTIME_DIR/systemd/user/$unit.d/50-ds4-memory.conf
want=$(sed -n 's/^MemoryMax=//p' "$dropin" 2>/dev/null)
have=$(systemctl --user show -P MemoryMax $unit)
[[ -n $want && $have == "$want" ]] && pass "MemoryMax=$want reached the unit (drop-in $dropin)" || fail "MemoryMax: unit $have, drop-in '$want'"
jq_oom=$(journalctl "${after[@]}" DS4_EVENT=oom DS4_WORKER=0 -o cat 2>/dev/null | head -1)
[[ -n $jq_oom ]] && pass "journal: $jq_oom" || fail "no DS4_EVENT=oom entry in the journal"
journalctl "${after[@]}" DS4_EVENT=oom -o export 2>/dev/null | grep -q '^DS4_CONTEXT_TO=256' && pass "journal entry has DS4_CONTEXT_FROM/TO" || fail "DS4_CONTEXT_TO=256 missing"
kline=$(journalctl "${after[@]}" -k -o cat 2>/dev/null | grep -m1 "oom-kill:.*task_memcg=[^,]*/$unit,")
[[ -n $kline ]] && pass "kernel: ${kline:0:150}..." || fail "no kernel oom-kill line for $unit"
# OOM kill -> ready: the kernel line's time to the supervisor's "ready" entry.
t_kill=$(journalctl "${after[@]}" -k -o export 2>/dev/null | awk -v u="$unit" '/^__REALTIME_TIMESTAMP=/ {t=substr($0,22)} /^MESSAGE=oom-kill:/ && index($0, u) {print t; exit}')
t_ready=$(journalctl "${after[@]}" DS4_WORKER=0 SYSLOG_IDENTIFIER=ds4-supervisor -o export 2>/dev/null | awk '/^__REALTIME_TIMESTAMP=/ {t=substr($0,22)} /^DS4_DOWNTIME_MS=/ {print t; exit}')
if [[ -n $t_kill && -n $t_ready ]]; then
  echo "measured: OOM kill (kernel line) -> worker ready again: $(((t_ready - t_kill) / 1000)) ms; supervisor's own figure (exit seen -> READY=1): $(sup_get 'w[0].get("last_downtime_ms")') ms (systemd backend, $(basename "$model"), ${DS4_OOM_SLOTS:-256} slots)"
else
  echo "note - could not time the OOM kill from the journal (kill=$t_kill ready=$t_ready)"
fi

# --- 2. A person's SIGKILL ---
kill -KILL "$pid"
if sup_wait 20 'w[0]["state"] == "ready" and w[0]["pid"] not in (0, '"$pid"')'; then
  pass "SIGKILL by hand: restarted ($(sup_get 'w[0]["last_exit"]'))"
else
  fail "not restarted after SIGKILL: $(sup_status | tr -d '\n' | cut -c1-400)"
fi
[[ $(sup_get 'w[0]["oom_kills"]') == 1 && $(sup_get 'w[0]["context"]') == 256 ]] \
  && pass "not counted as an OOM kill, context stays 256" || fail "oom_kills $(sup_get 'w[0]["oom_kills"]'), context $(sup_get 'w[0]["context"]')"
[[ $(sup_get 'w[0]["last_exit"]') == killed* ]] && pass "told apart: last_exit '$(sup_get 'w[0]["last_exit"]')'" || fail "last_exit: $(sup_get 'w[0]["last_exit"]')"

# --- 3. Supervisor SIGKILL and restart ---
pid=$(sup_get 'w[0]["pid"]')
kill -KILL "$SUP_PID"; wait "$SUP_PID" 2>/dev/null; SUP_PID=
[[ $(systemctl --user is-active $unit) == active ]] && pass "the worker unit survives the supervisor's SIGKILL" || fail "unit $(systemctl --user is-active $unit)"
sup_start "$SUP_DIR/ds4.yaml" || fail "supervisor did not come back"
if sup_wait 30 'w[0]["state"] == "ready"'; then
  [[ $(sup_get 'w[0]["pid"]') == "$pid" ]] && pass "re-adopted: same worker pid $pid, no restart" || fail "worker pid $(sup_get 'w[0]["pid"]'), was $pid"
  [[ $(sup_get 'w[0]["context"]') == 256 ]] && pass "status after re-adoption: context 256" || fail "context $(sup_get 'w[0]["context"]')"
else
  fail "not ready after the supervisor restart"
fi
[[ $(sup_get 's["model"]["reused"]') == True ]] && pass "the model segment was reused" || fail "segment not reused"

# --- 4. Crash loop under systemd ---
write_config cuda:7
"$DS4_BIN/ds4ctl" reload >/dev/null || fail "ds4ctl reload"
if sup_wait 30 'w[0]["failures"] >= 7 and w[0]["degraded"]'; then
  pass "crash loop: degraded after $(sup_get 'w[0]["failures"]') failures"
else
  fail "no crash loop: $(sup_status | tr -d '\n' | cut -c1-400)"
fi
[[ $(sup_get 'w[0]["last_error"]') == *CUDA* ]] && pass "error shown: $(sup_get 'w[0]["last_error"]')" || fail "last_error: $(sup_get 'w[0]["last_error"]')"
res=$(systemctl --user show -P Result $unit)
[[ $res != start-limit-hit ]] && pass "no start-limit-hit (Result=$res)" || fail "the unit ended in start-limit-hit"
write_config cpu
"$DS4_BIN/ds4ctl" reload >/dev/null
sup_wait 30 'w[0]["state"] == "ready"' && pass "fixed config: ready again" || fail "not ready after the fix"

sup_stop
[[ $SUP_RC == 0 ]] && pass "SIGTERM: clean exit" || fail "supervisor exit status $SUP_RC"
state=$(systemctl --user is-active $unit)
[[ $state == inactive ]] && pass "the supervisor stopped its worker unit" || fail "unit is $state after the supervisor stopped"
stop_entry=$(journalctl "${after[@]}" DS4_EVENT=stop DS4_WORKER=0 -o cat 2>/dev/null | tail -1)
[[ $stop_entry == *"the supervisor is stopping"* ]] && pass "journal: DS4_EVENT=stop: $stop_entry" \
  || fail "no DS4_EVENT=stop entry for the worker's stop (got '$stop_entry')"
sup_finish
