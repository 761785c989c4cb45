#!/usr/bin/env bash
# workers.engine: exec on the systemd backend, against a real user manager and
# journal (lib/systemd_env.sh): ds4-worker@0.service runs the external engine
# (lib/ds4_engine.sh) from the command template. Context 2048 x 256 slots
# cannot fit MemoryMax=300MiB: the kernel OOM-kills the engine inside the
# unit's cgroup; the supervisor restarts it one rung lower with {ctx} = 256;
# then chat completions go through the proxy to it, and ds4ctl status and
# /health show the unit.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/systemd_env.sh"
. "$here/lib/supervisor_env.sh"

model=${DS4_MODELS:-${DS4_SRC:-}/../shared/models}/stories260K.gguf
[[ -f $model ]] || { echo "SKIP: no $model"; exit 77; }
command -v setpriv >/dev/null || { echo "SKIP: no setpriv (util-linux)"; exit 77; }
ds4_systemd_start || exit $?
SUP_PRIVATE_RUNTIME=0 sup_init || { ds4_systemd_stop; exit 77; }
cleanup() { sup_cleanup; ds4_systemd_stop; }
trap cleanup EXIT
unit=ds4-worker@0.service
cursor=$(journalctl --show-cursor -n 0 -q 2>/dev/null | sed -n 's/^-- cursor: //p')
after=(--cursor "$cursor" --no-pager -q)

# The unit does not inherit this shell's environment: the template passes
# what the engine script needs through env(1).
cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $model
  name: stories
proxy:
  listen: 127.0.0.1:0
workers:
  backend: systemd
  slots: 256
  threads: 1
  context:
    ladder: [2048, 256]       # x 256 slots: 320 MiB of KV at 2048, 40 MiB at 256
  memory_max: 300MiB         # 2048: ~425 MiB of the worker's own; 256: ~45 MiB, ~140 MiB when it links CUDA's libraries
  reserve: 64MiB
  engine: exec
  exec:
    command: "env DS4_BIN=$DS4_BIN DS4_ENGINE_DIR=$SUP_DIR bash $here/lib/ds4_engine.sh {port} {ctx} {slots} {model}"
headroom:
  min_available: 64MiB
  step_up_after: 0
restart:
  backoff_initial: 200ms
  backoff_max: 800ms
YAML
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; sup_finish; }
[[ $(sup_get 's["backend"]') == systemd ]] && pass "systemd backend in use" || fail "backend: $(sup_get 's["backend"]')"
if sup_wait 90 'w[0]["state"] == "ready" and w[0]["context"] == 256'; then
  pass "the exec engine is ready at context 256, one rung below the largest"
else
  fail "not ready at 256: $(sup_status | tr -d '\n' | cut -c1-600)"
  journalctl "${after[@]}" -u "$unit" -o cat 2>/dev/null | tail -20
  sup_finish
fi
[[ $(sup_get 'w[0]["oom_kills"]') == 1 ]] && pass "status: oom_kills 1 ($(sup_get 'w[0]["last_exit"]'))" \
  || fail "status: oom_kills $(sup_get 'w[0]["oom_kills"]'), last exit: $(sup_get 'w[0]["last_exit"]')"
[[ $(sup_get 'w[0]["unit"]') == "$unit" && $(sup_get 'w[0]["engine"]') == exec ]] && pass "status names $unit, engine exec" \
  || fail "unit: $(sup_get 'w[0]["unit"]'), engine: $(sup_get 'w[0]["engine"]')"
kline=$(journalctl "${after[@]}" -k -o cat 2>/dev/null | grep -m1 "oom-kill:.*task_memcg=[^,]*/$unit,")
[[ -n $kline ]] && pass "kernel: ${kline:0:150}..." || fail "no kernel oom-kill line for $unit"
port=$(sup_get 'w[0]["port"]')
if pgrep -f "ds4-worker serve .*ds4-engine-$port.sock --context 256 " >/dev/null; then
  pass "the engine runs with {ctx} = 256 on port $port"
else fail "no engine at context 256 on port $port: $(pgrep -af ds4-engine- | head -3)"; fi

url=http://$(sed -n 's/^ds4-supervisor: proxy listening on \([0-9.]*:[0-9]*\).*/\1/p' "$SUP_DIR/sup.log" | tail -1)
health=$(curl -s --max-time 10 -w ' %{http_code}' "$url/health")
[[ $health == *'"workers_ready":1'*' 200' ]] && pass "/health: 200, one worker ready" || fail "/health: $health"
out=$(curl -s --max-time 30 -N "$url/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model":"stories","messages":[{"role":"user","content":"Once upon a time"}],"max_tokens":8,"stream":true}')
[[ $out == *'"delta"'* && $out == *'data: [DONE]'* ]] && pass "a chat stream through the proxy and the engine" \
  || fail "chat stream: ${out:0:300}"

sup_stop
((SUP_RC == 0)) && pass "supervisor stopped cleanly" || fail "supervisor exit status $SUP_RC"
sup_finish
