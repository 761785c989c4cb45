#!/usr/bin/env bash
# workers.engine: exec, process backend: the worker is an external
# OpenAI-compatible server (lib/ds4_engine.sh: ds4-worker serve behind the
# standalone ds4-proxy) started from the command template. Checks: it starts
# at the largest rung; chat completions through the supervisor's proxy,
# stream and not, Anthropic's too, and the official SDK clients (when
# tests/js/node_modules is installed); API keys are the supervisor's;
# /health and ds4ctl status show the worker; requests sent
# while the engine is SIGKILLed all complete after it restarts (replayed
# before their first byte); a stream cut after its first byte ends with an
# error event instead of hanging.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"

command -v setpriv >/dev/null || { echo "SKIP: no setpriv (util-linux)"; exit 77; }
sup_begin
[[ -x $DS4_BIN/ds4-proxy ]] || { echo "SKIP: no $DS4_BIN/ds4-proxy"; exit 77; }
export DS4_BIN DS4_ENGINE_DIR=$SUP_DIR

echo sk-test-1 >"$SUP_DIR/keys"
cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $model
  name: stories
proxy:
  listen: 127.0.0.1:0
  api_keys_file: $SUP_DIR/keys   # checked by the supervisor's proxy, not passed on
workers:
  backend: process
  slots: 2
  threads: 1
  context:
    ladder: [256, 128]
  reserve: 64MiB
  engine: exec
  exec:
    command: "bash $here/lib/ds4_engine.sh {port} {ctx} {slots} {model}"
headroom:
  min_available: 64MiB
  step_up_after: 0
YAML
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; sup_finish; }

if sup_wait 60 'w[0]["state"] == "ready"'; then pass "the exec worker is ready"
else fail "exec worker not ready: $(sup_status | tr -d '\n' | cut -c1-600)"; sup_finish; fi
if sup_check 'w[0]["context"] == 256 and w[0]["engine"] == "exec" and w[0]["port"] > 0 and w[0]["pid"] > 0'; then
  pass "ds4ctl status: engine exec at the largest rung (256), port $(sup_get 'w[0]["port"]')"
else fail "status: $(sup_status | tr -d '\n' | cut -c1-600)"; fi
# The engine loads the model itself: the supervisor keeps no copy of the weights.
if sup_check 's["model"]["segment"] == "" and s["model"]["backing"].startswith("none")' && ! grep -q 'ds4-model-' "/proc/$SUP_PID/maps"; then
  pass "the supervisor keeps no copy of the weights: $(sup_get 's["model"]["backing"]')"
else fail "the supervisor holds a model segment: $(sup_get 's["model"]') $(grep -c 'ds4-model-' "/proc/$SUP_PID/maps") mappings"; fi
# The supervisor's own proxy (the engines' ds4-proxy logs to the same file).
url=http://$(sed -n 's/^ds4-supervisor: proxy listening on \([0-9.]*:[0-9]*\).*/\1/p' "$SUP_DIR/sup.log" | tail -1)
[[ $url == http://*:* ]] || { fail "no proxy address in the log"; sup_finish; }

health=$(curl -s --max-time 10 -w ' %{http_code}' "$url/health")
if [[ $health == *'"workers_ready":1'*' 200' ]]; then pass "/health: 200, one worker ready"
else fail "/health: $health"; fi

python3 - "$url" <<'PY' && pass "chat completions, whole and streamed, and an Anthropic stream, through the exec engine" || fail "chat completions"
import json, sys, urllib.request
url = sys.argv[1]
def post(body, timeout=30):
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json", "authorization": "Bearer sk-test-1"})
    return urllib.request.urlopen(req, timeout=timeout)
msgs = [{"role": "user", "content": "Once upon a time"}]
with post({"model": "stories", "messages": msgs, "max_tokens": 12, "temperature": 0}) as r:
    j = json.loads(r.read())
    assert r.status == 200, r.status
    text = j["choices"][0]["message"]["content"]
    assert isinstance(text, str) and text, j
with post({"model": "stories", "messages": msgs, "max_tokens": 12, "temperature": 0, "stream": True}) as r:
    assert r.headers["content-type"].startswith("text/event-stream"), r.headers["content-type"]
    events = [l[6:] for l in r.read().decode().split("\n") if l.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    streamed = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert streamed == text, (streamed, text)
# Anthropic's API goes through as well, its events unchanged.
req = urllib.request.Request(url + "/v1/messages", json.dumps(
    {"model": "stories", "max_tokens": 8, "stream": True, "messages": msgs}).encode(),
    {"content-type": "application/json", "anthropic-version": "2023-06-01", "x-api-key": "sk-test-1"})
with urllib.request.urlopen(req, timeout=30) as r:
    events = [l[7:] for l in r.read().decode().split("\n") if l.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop", events
# An error from the engine passes through with its status.
try:
    post({"model": "stories", "messages": "not a list"})
    sys.exit("a bad request was accepted")
except urllib.error.HTTPError as e:
    assert e.code == 400, e.code
PY

# The official SDKs, as for native workers (their answers come from the engine).
if command -v node >/dev/null && [[ -d $DS4_SRC/tests/js/node_modules ]]; then
  expected=$("$DS4_BIN/ds4-worker" run --model "$model" -p "Once upon a time" -n 24 --temp 0 --json 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["text"])')
  if (cd "$DS4_SRC/tests/js" && timeout 180 node proxy_clients.mjs "$url" sk-test-1 "$expected" >"$SUP_DIR/sdk.out" 2>&1); then
    pass "openai and @anthropic-ai/sdk clients through the exec engine"
  else fail "SDK clients: $(grep FAIL "$SUP_DIR/sdk.out" | head -3)"; fi
else
  echo "note: tests/js/node_modules missing (scripts/test.sh installs it): the SDK checks are skipped"
fi

# Freeze the engine, send 6 requests: 2 go to it (slots: 2) and get no
# answer, 4 wait in the queue. SIGKILL the engine: the 2 go back to the queue
# (nothing reached their clients) and all 6 complete once it has restarted.
# The engine's HTTP server: the ds4-proxy on the worker's port.
engine_pid() { pgrep -f "ds4-proxy .*--listen 127.0.0.1:$(sup_get 'w[0]["port"]') " | head -1; }
metric() { curl -s --max-time 5 "$url/metrics" | sed -n "s/^$1 //p"; }
epid=$(engine_pid)
[[ -n $epid ]] || { fail "no engine process under the worker"; sup_finish; }
broken_before=$(metric ds4_worker_calls_broken_total)
kill -STOP "$epid"
python3 - "$url" >"$SUP_DIR/six.out" 2>&1 <<'PY' &
import json, sys, urllib.request, concurrent.futures as cf
url = sys.argv[1]
def one(i):
    body = {"model": "stories", "messages": [{"role": "user", "content": "Tell a story %d" % i}],
            "max_tokens": 16, "temperature": 0, "stream": i % 2 == 1}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json", "authorization": "Bearer sk-test-1"})
    with urllib.request.urlopen(req, timeout=60) as r:
        data = r.read().decode()
        assert r.status == 200, r.status
        if body["stream"]:
            assert data.rstrip().endswith("data: [DONE]"), data[-200:]
            assert '"error"' not in data, data[-300:]
        else:
            assert json.loads(data)["choices"][0]["message"]["content"]
    return True
with cf.ThreadPoolExecutor(6) as ex:
    assert all(ex.map(one, range(6)))
PY
six=$!
for _ in $(seq 100); do [[ $(metric ds4_queue_waiting) == 4 && $(metric ds4_requests_in_flight) == 2 ]] && break; sleep 0.1; done
if [[ $(metric ds4_queue_waiting) == 4 ]]; then pass "engine frozen: 2 requests on it, 4 waiting in the queue"
else fail "queue: waiting $(metric ds4_queue_waiting), in flight $(metric ds4_requests_in_flight)"; fi
kill -KILL "$epid"
if wait "$six"; then pass "all 6 requests completed after the engine's restart"
else fail "requests lost across the engine's death: $(tail -5 "$SUP_DIR/six.out")"; fi
broken=$(($(metric ds4_worker_calls_broken_total) - broken_before))
if ((broken >= 2)); then pass "the 2 requests on the dead engine were replayed ($broken broken calls)"
else fail "broken calls: $broken, expected at least 2"; fi
if sup_check 'w[0]["restarts"] >= 1 and w[0]["state"] == "ready"'; then pass "status: the worker restarted ($(sup_get 'w[0]["last_exit"]'))"
else fail "status after the kill: $(sup_status | tr -d '\n' | cut -c1-600)"; fi

# A stream whose engine dies after its first byte: an error event ends it.
sup_wait 30 'w[0]["state"] == "ready"'
python3 - "$url" "$(engine_pid)" <<'PY' && pass "a stream cut after its first byte ends with an error event" || fail "stream cut mid-answer"
import json, os, signal, subprocess, sys, time, urllib.request
url, engine = sys.argv[1], int(sys.argv[2])
body = {"model": "stories", "messages": [{"role": "user", "content": "Once upon a time"}],
        "max_tokens": 200, "temperature": 1.0, "seed": 7, "stream": True}
req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                             {"content-type": "application/json", "authorization": "Bearer sk-test-1"})
t0 = time.monotonic()
with urllib.request.urlopen(req, timeout=30) as r:
    first = r.readline()
    while not first.startswith(b"data: "):
        first = r.readline()
    os.kill(engine, signal.SIGSTOP)  # freeze it at once, then kill it
    os.kill(engine, signal.SIGKILL)
    rest = r.read().decode()
assert time.monotonic() - t0 < 20, "the stream hung"
events = [l[6:] for l in rest.split("\n") if l.startswith("data: ")]
assert events, rest
last = json.loads(events[-1])
assert "error" in last and "mid-answer" in last["error"]["message"], events[-1]
PY

no_key=$(curl -s -o /dev/null --max-time 10 -w '%{http_code}' "$url/v1/chat/completions" -H 'content-type: application/json' -d '{}')
[[ $no_key == 401 ]] && pass "no API key: 401 from the supervisor's proxy" || fail "no API key: $no_key"
if sup_wait 30 'w[0]["state"] == "ready"' &&
   [[ $(curl -s -o /dev/null --max-time 30 -w '%{http_code}' "$url/v1/completions" -H 'content-type: application/json' \
        -H 'Authorization: Bearer sk-test-1' -d '{"model":"stories","prompt":"Once upon a time","max_tokens":8}') == 200 ]]; then
  pass "serving again after the cut stream"
else fail "not serving after the cut stream"; fi

sup_stop
if ((SUP_RC == 0)); then pass "supervisor stopped cleanly"; else fail "supervisor exit status $SUP_RC"; fi
sleep 0.5
if pgrep -f "$SUP_DIR/ds4-engine-" >/dev/null; then fail "an engine outlived the supervisor: $(pgrep -af "$SUP_DIR/ds4-engine-")"
else pass "no engine left"; fi
sup_finish
