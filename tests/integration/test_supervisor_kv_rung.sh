#!/usr/bin/env bash
# The KV cache rung (workers.kv_cache: [f16, q8_0]), with a real OOM kill:
# a worker in a cgroup-v1 memory cgroup (workers.memory_max) whose f16 cache
# at context 2048 cannot fit is OOM-killed while it touches it; the
# supervisor restarts it at once at the same context with a q8_0 cache (53%
# of the memory), which fits. The journal line, `ds4ctl status`, `ds4ctl
# events` and /metrics say so, the worker process really runs with
# DS4_KV_CACHE=q8_0, and it answers through the proxy.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"

sup_init_memory_cgroup ds4-kv
# Heads of 32 (q8_0 keeps 32 values a block): 3 layers x 2 KV heads x 32 x
# (K, V) = 768 bytes a position in f16. 2048 positions x 64 slots: 96 MiB in
# f16, 51 MiB in q8_0.
model=$SUP_DIR/kv.gguf
sup_synthetic_model "$model" --dim 128 --layers 3 --ff 320 --heads 4 --kv-heads 2 --ctx 2048 --no-byte-tokens --seed 5

cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $model
proxy:
  listen: 127.0.0.1:0
workers:
  backend: process
  slots: 64
  threads: 1
  context:
    ladder: [2048, 256]
  kv_cache: [f16, q8_0]
  memory_max: 80MiB
  reserve: 16MiB
headroom:
  min_available: 16MiB
  step_up_after: 0
YAML
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; exit 1; }

if sup_wait 60 'w[0]["state"] == "ready" and w[0]["kv_cache"] == "q8_0"'; then
  pass "worker ready with a q8_0 KV cache after the OOM kill"
else
  fail "worker not ready with q8_0: $(sup_status | tr -d '\n' | cut -c1-600)"
fi
ctx=$(sup_get 'w[0]["context"]')
[[ $ctx == 2048 ]] && pass "the same context, 2048: the KV rung comes before a smaller context" \
  || fail "context $ctx, expected 2048"
oom=$(sup_get 'w[0]["oom_kills"]')
[[ $oom == 1 ]] && pass "status: oom_kills 1" || fail "status: oom_kills $oom, expected 1"
pid=$(sup_get 'w[0]["pid"]')
tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx 'DS4_KV_CACHE=q8_0' \
  && pass "the worker process runs with DS4_KV_CACHE=q8_0 (/proc)" || fail "worker environment lacks DS4_KV_CACHE=q8_0"
grep -q 'DS4_EVENT=oom, DS4_WORKER=0, DS4_CONTEXT_FROM=2048, DS4_CONTEXT_TO=2048.*DS4_KV_CACHE_FROM=f16, DS4_KV_CACHE_TO=q8_0' \
  "$SUP_DIR/sup.log" && pass "oom event logged: $(grep -m1 'DS4_EVENT=oom' "$SUP_DIR/sup.log" | cut -c1-200)" \
  || fail "no DS4_EVENT=oom f16 -> q8_0 entry in the log: $(grep -m1 'DS4_EVENT=oom' "$SUP_DIR/sup.log")"
grep -q 'memory reserved: .*KV cache .*(context 2048 x 64 slots, q8_0)' "$SUP_DIR/sup.log" \
  && pass "the worker's plan: $(grep -m1 'memory reserved: .*q8_0' "$SUP_DIR/sup.log" | sed 's/.*memory reserved: //' | cut -c1-160)" \
  || fail "no q8_0 memory plan in the worker's log"
"$DS4_BIN/ds4ctl" status | grep -q "KV cache: q8_0" && pass "ds4ctl status shows the KV cache" \
  || fail "ds4ctl status: $("$DS4_BIN/ds4ctl" status | head -5)"
"$DS4_BIN/ds4ctl" events | grep -q "oom .*2048/f16 -> 2048/q8_0" && pass "ds4ctl events: $("$DS4_BIN/ds4ctl" events | grep -m1 oom | cut -c1-120)" \
  || fail "ds4ctl events: $("$DS4_BIN/ds4ctl" events | head -5)"
url=$(sup_proxy_url)
curl -s "$url/metrics" | grep -q '^ds4_worker_kv_cache_q8{worker="0"} 1$' && pass "/metrics: ds4_worker_kv_cache_q8 1" \
  || fail "/metrics lacks ds4_worker_kv_cache_q8 1"
body=$(sup_complete "$url" kv)
code=${body##*$'\n'}
[[ $code == 200 && $body == *'"text"'* ]] && pass "it answers through the proxy: $(echo "$body" | head -1 | cut -c1-120)" \
  || fail "completion: $body"

sup_stop
[[ $SUP_RC == 0 ]] && pass "SIGTERM: clean exit" || fail "supervisor exit status $SUP_RC"
sup_finish
