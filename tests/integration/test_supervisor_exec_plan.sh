#!/usr/bin/env bash
# The memory plan of an exec engine (issue 23): the real llama-server (the
# peer) on stories260K, a ladder whose top rung does not fit. The plan comes
# from the GGUF (layers x KV heads x key+value length x f16, for the
# command's -c) plus workers.exec.overhead; workers.reserve is set so that
# about 1.5 GiB of MemAvailable is left to plan with: the top rung (4M tokens:
# 2.5 GiB of KV) does not fit, the second (256K tokens: 160 MiB + 512 MiB)
# does. Required, from the log: the first start decision is at the second
# rung, no downgrade or failed start came before it, and llama-server runs
# with -c 262144. Also model.keep_resident (on by default for exec engines):
# ds4ctl status shows the file resident, locked (root) or re-touched.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"
source "$here/lib/peer.sh"
peer_require
sup_begin
T=$SUP_DIR
base=${DS4_TEST_PORT_BASE:-18700}
export DS4_EXEC_PORTS="$((base + 50))-$((base + 59))"
avail=$(($(awk '/^MemAvailable:/ { print $2 }' /proc/meminfo) * 1024))
reserve=$((avail - (3 << 29)))  # 1.5 GiB left to plan with
((reserve > 0)) || { echo "SKIP: less than 1.5 GiB available"; exit 77; }
cat >"$T/ds4.yaml" <<YAML
model:
  path: $model
  name: stories
proxy:
  listen: 127.0.0.1:$((base + 2))
workers:
  backend: process
  slots: 1
  context:
    ladder: [4194304, 262144, 8192]
  reserve: $reserve
  engine: exec
  exec:
    command: "$peer_bin/llama-server -m {model} --host 127.0.0.1 --port {port} -c {ctx} -np {slots} -t 1 --no-webui"
    overhead: 512MiB
headroom:
  min_available: 64MiB
  step_up_after: 0
YAML
sup_start "$T/ds4.yaml" || { fail "the supervisor did not start"; sup_finish; }
if sup_wait 120 'w[0]["state"] == "ready"'; then pass "llama-server ready (pid $(sup_get 'w[0]["pid"]'))"
else fail "llama-server not ready: $(sup_status | tr -d '\n' | cut -c1-400)"; sup_finish; fi
grep -a -m1 'exec engine plan' "$T/sup.log" | cut -c1-400
first=$(grep -a -m1 'DS4_EVENT=start' "$T/sup.log")
if [[ $first == *'DS4_CONTEXT_TO=262144'* ]]; then pass "the first start took the second rung: $(grep -o 'worker 0: start at [0-9]*: [^;]*' <<<"$first" | head -1 | cut -c1-200)"
else fail "the first start: ${first:0:300}"; fi
bad=$(grep -ac 'DS4_EVENT=\(downgrade\|no_fit\|backoff\|oom\)' "$T/sup.log")
if [[ $bad == 0 ]]; then pass "no downgrade, failed start or backoff on the way"; else fail "$bad downgrade/no-fit entries: $(grep -a -m1 'DS4_EVENT=downgrade\|DS4_EVENT=no_fit' "$T/sup.log" | cut -c1-200)"; fi
if sup_check 'w[0]["context"] == 262144 and w[0]["restarts"] == 0'; then pass "status: context 262144, 0 restarts"
else fail "status: context $(sup_get 'w[0]["context"]'), restarts $(sup_get 'w[0]["restarts"]')"; fi
wpid=$(sup_get 'w[0]["pid"]')
epid=$(pgrep -P "$wpid" -x llama-server)
if tr '\0' ' ' <"/proc/$epid/cmdline" | grep -q -- '-c 262144 '; then pass "llama-server runs with -c 262144"
else fail "llama-server's command line: $(tr '\0' ' ' <"/proc/$epid/cmdline")"; fi
U=$(sup_proxy_url)
code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 30 "$U/v1/completions" -d '{"prompt":"Once upon a time","max_tokens":8,"temperature":0}')
if [[ $code == 200 ]]; then pass "it serves at that rung"; else fail "a completion: HTTP $code"; fi
# model.keep_resident: the file is held for the engine.
sup_wait 30 's["model"].get("resident", {}).get("mode") in ("mlock", "touch")' || true
if sup_check 's["model"]["resident"]["resident"] == s["model"]["resident"]["bytes"] and s["model"]["resident"]["mode"] in ("mlock", "touch")'; then
  pass "ds4ctl status: the model file kept resident ($(sup_get 's["model"]["resident"]'))"
else fail "ds4ctl status: model.resident $(sup_get 's["model"].get("resident")')"; fi
"$DS4_BIN/ds4ctl" status | grep '^resident' || fail "ds4ctl status prints no 'resident' line"
sup_finish
