#!/usr/bin/env bash
# Headroom: a test process allocates and touches memory until MemAvailable is
# below headroom.min_available (set relative to the machine's current
# figure); the worker is drained and restarted one rung lower with no OOM
# kill. When the memory is freed and step_up_after has passed, it steps back
# up. SUP_BACKEND=systemd runs the same with worker units under a private
# user manager (lib/systemd_env.sh). Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"

model=${DS4_MODELS:-$DS4_SRC/../shared/models}/stories260K.gguf
[[ -f $model ]] || { echo "SKIP: no $model"; exit 77; }
avail_kb=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
gib=$((1024 * 1024))
if ((avail_kb < 5 * gib)); then echo "SKIP: needs 5 GiB available to push headroom down, have $((avail_kb / 1024)) MiB"; exit 77; fi
if [[ ${SUP_BACKEND:-process} == systemd ]]; then
  . "$here/lib/systemd_env.sh"
  ds4_systemd_start || exit $?
  SUP_PRIVATE_RUNTIME=0 sup_init || { ds4_systemd_stop; exit 77; }
else
  sup_init || exit $?
fi
hog=
cleanup() {
  # Only the hog: a bare `wait` would also wait for the user manager.
  [[ -n $hog ]] && { kill "$hog" 2>/dev/null; wait "$hog" 2>/dev/null; }
  sup_cleanup
  [[ ${SUP_BACKEND:-process} == systemd ]] && ds4_systemd_stop
}
trap cleanup EXIT

# min_available: 2 GiB below what is available now; the hog takes 3 GiB.
min_kb=$((avail_kb - 2 * gib))
cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $model
proxy:
  listen: 127.0.0.1:0         # any free port: tests run side by side
workers:
  backend: ${SUP_BACKEND:-process}
  slots: 64
  threads: 1
  context:
    ladder: [2048, 256]
  reserve: 64MiB
headroom:
  min_available: ${min_kb}KiB
  for: 1s
  step_up_after: 3s
YAML
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; exit 1; }
sup_wait 30 'w[0]["state"] == "ready" and w[0]["context"] == 2048' && pass "starts at 2048" \
  || fail "not ready at 2048: $(sup_status | tr -d '\n' | cut -c1-400)"
pid0=$(sup_get 'w[0]["pid"]')

# The hog: 3 GiB written (so really resident), held until killed.
python3 -c '
import signal, sys, time
b = bytearray(b"\x01") * (3 << 30)
print("hog holding", len(b) >> 20, "MiB", flush=True)
time.sleep(120)' &
hog=$!
t0=${EPOCHREALTIME/[.,]/}
if sup_wait 30 'w[0]["state"] == "ready" and w[0]["context"] == 256'; then
  t1=${EPOCHREALTIME/[.,]/}
  pass "low headroom: restarted at 256 after $(((t1 - t0) / 1000)) ms (for: 1s)"
else
  fail "no downgrade: $(sup_status | tr -d '\n' | cut -c1-400)"
fi
oom=$(sup_get 'w[0]["oom_kills"]')
[[ $oom == 0 ]] && pass "no OOM kill" || fail "oom_kills $oom"
grep -q 'DS4_EVENT=downgrade, DS4_WORKER=0, DS4_CONTEXT_FROM=2048, DS4_CONTEXT_TO=256, DS4_REASON=headroom low' "$SUP_DIR/sup.log" \
  && pass "downgrade logged with its reason" || fail "no downgrade event in the log"
# While the memory is held it must not step up again.
sleep 4
[[ $(sup_get 'w[0]["context"]') == 256 ]] && pass "stays at 256 while memory is short" || fail "stepped up while memory was short"

kill "$hog"; wait "$hog" 2>/dev/null; hog=
if sup_wait 30 'w[0]["state"] == "ready" and w[0]["context"] == 2048'; then
  pass "memory freed: stepped back up to 2048"
else
  fail "no step up: $(sup_status | tr -d '\n' | cut -c1-400)"
fi
grep -q 'DS4_EVENT=upgrade, DS4_WORKER=0, DS4_CONTEXT_FROM=256, DS4_CONTEXT_TO=2048' "$SUP_DIR/sup.log" \
  && pass "upgrade logged" || fail "no upgrade event in the log"
metrics=$(curl -s --max-time 10 "$(sup_proxy_url)/metrics")
if grep -qF 'ds4_worker_decisions_total{worker="0",event="downgrade"} 1' <<<"$metrics" &&
   grep -qF 'ds4_worker_decisions_total{worker="0",event="upgrade"} 1' <<<"$metrics" &&
   grep -qF 'ds4_worker_decisions_total{worker="0",event="oom"} 0' <<<"$metrics"; then
  pass "/metrics counts the decisions: 1 downgrade, 1 upgrade, 0 oom"
else
  fail "/metrics decisions: $(grep ds4_worker_decisions_total <<<"$metrics" | tr '\n' ' ')"
fi
line=$("$DS4_BIN/ds4ctl" status | grep 'decisions:')
[[ $line == *"1 downgrade, 1 upgrade"* ]] && pass "ds4ctl status shows them:$line" || fail "ds4ctl status decisions line: '$line'"
"$DS4_BIN/ds4ctl" events | sed 's/^/       /'
sup_stop
[[ $SUP_RC == 0 ]] && pass "SIGTERM: clean exit" || fail "supervisor exit status $SUP_RC"
sup_finish 30
