#!/usr/bin/env bash
# Process backend, OOM ladder: workers are child processes in a cgroup-v1
# memory cgroup (workers.memory_max) the test makes; context 2048 x 256 slots
# cannot fit 150 MiB, so the kernel OOM-kills the worker while it touches its
# KV cache; the supervisor restarts it at once at 256, and status shows one
# OOM kill and the restart. Prints the time from the kill to ready again.
# Measuring another model: DS4_OOM_MODEL=FILE DS4_OOM_SLOTS=N DS4_OOM_MEMORY_MAX=SIZE
# (slots and limit such that context 2048 cannot fit and 256 can).
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"

model=${DS4_OOM_MODEL:-${DS4_MODELS:-$DS4_SRC/../shared/models}/stories260K.gguf}
[[ -f $model ]] || { echo "SKIP: no $model"; exit 77; }
sup_init_memory_cgroup ds4-test
cg=$SUP_CGROUP

cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $model
proxy:
  listen: 127.0.0.1:0         # any free port: tests run side by side
workers:
  backend: process
  slots: ${DS4_OOM_SLOTS:-256}
  threads: 1
  context:
    ladder: [2048, 256]      # 2048 x 256 slots: 320 MiB of KV; 256: 40 MiB
  memory_max: ${DS4_OOM_MEMORY_MAX:-150MiB}
  reserve: 64MiB
headroom:
  min_available: 64MiB
  step_up_after: 0
YAML
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; exit 1; }

if sup_wait 60 'w[0]["state"] == "ready" and w[0]["context"] == 256'; then
  pass "worker ready at context 256 after the OOM kill"
else
  fail "worker not ready at 256: $(sup_status | tr -d '\n' | cut -c1-600)"
fi
oom=$(sup_get 'w[0]["oom_kills"]')
restarts=$(sup_get 'w[0]["restarts"]')
[[ $oom == 1 ]] && pass "status: oom_kills 1" || fail "status: oom_kills $oom, expected 1"
[[ $restarts == 1 ]] && pass "status: restarts 1" || fail "status: restarts $restarts, expected 1"
args=$(sup_get '" ".join(w[0]["args"])')
[[ $args == *"--context 256"* ]] && pass "the worker really runs with --context 256 (/proc)" || fail "worker args: $args"
adj=$(cat "/proc/$(sup_get 'w[0]["pid"]')/oom_score_adj" 2>/dev/null)
[[ $adj == 1000 ]] && pass "the worker's oom_score_adj is 1000, as a unit's OOMScoreAdjust: the kernel picks it first" \
  || fail "worker oom_score_adj '$adj', expected 1000"
grep -q 'DS4_EVENT=oom, DS4_WORKER=0, DS4_CONTEXT_FROM=2048, DS4_CONTEXT_TO=256' "$SUP_DIR/sup.log" \
  && pass "oom event logged: $(grep -m1 'DS4_EVENT=oom' "$SUP_DIR/sup.log" | cut -c1-160)" \
  || fail "no DS4_EVENT=oom 2048 -> 256 entry in the log"
grep -q "oom_kill [1-9]" "$cg/ds4-worker-0/memory.oom_control" && pass "the kernel counted the OOM kill in $cg/ds4-worker-0" \
  || fail "memory.oom_control shows no oom_kill"
down=$(sup_get 'w[0].get("last_downtime_ms", -1)')
echo "measured: OOM kill -> worker ready again: ${down} ms (process backend, $(basename "$model"), ${DS4_OOM_SLOTS:-256} slots)"

sup_stop
[[ $SUP_RC == 0 ]] && pass "SIGTERM: clean exit" || fail "supervisor exit status $SUP_RC"
sup_finish
