#!/usr/bin/env bash
# A stop (SIGTERM: `systemctl --user stop` or `restart`) answers the requests in
# flight before it stops the workers: a streamed completion that is being
# generated when the signal comes ends with its last tokens, its usage and
# [DONE]; no new connection is taken meanwhile; the supervisor then exits 0.
# A second signal does not wait. Process backend, CPU worker, on a synthetic
# 207M model (q8_0, 25-60 tokens/s on one thread, so an answer of 60 tokens
# takes about a second or more; the second case asks for 400, which a second
# signal 0.8 s in must cut on any CPU this runs on). Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"

sup_init || exit $?
unset DBUS_SESSION_BUS_ADDRESS
trap sup_cleanup EXIT

model=$SUP_DIR/m207.gguf
sup_synthetic_model "$model" --preset 207m --type q8_0
cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $model
  name: m207
proxy:
  listen: 127.0.0.1:0         # any free port: tests run side by side
workers:
  backend: process
  device: cpu
  threads: 1
  context:
    ladder: [512]
restart:
  drain_deadline: 60s         # longer than any answer here: the answers end the drain
YAML

# stream_through_stop URL PID SIGNALS [TOKENS]: streams a completion of TOKENS (60) and,
# once the first tokens came, sends the supervisor SIGTERM SIGNALS times (0.5 s
# apart); then tries a new connection. Prints a JSON summary.
stream_through_stop() {
  python3 - "$1" "$2" "$3" "${4:-60}" <<'PY'
import http.client, json, os, signal, socket, sys, time, urllib.parse
u = urllib.parse.urlparse(sys.argv[1])
pid, signals, tokens = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
c.request("POST", "/v1/completions", json.dumps({"model": "m207", "prompt": "Once upon a time", "max_tokens": tokens,
          "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}),
          {"Content-Type": "application/json"})
r = c.getresponse()
out = {"status": r.status, "before": 0, "after": 0, "done": False, "usage": None, "finish": None, "refused": None}
signalled = None
try:
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            out["done"] = True
            break
        ev = json.loads(line[6:])
        if ev.get("usage"):
            out["usage"] = ev["usage"]
        for ch in ev.get("choices", []):
            if ch.get("finish_reason"):
                out["finish"] = ch["finish_reason"]
            if ch.get("text"):
                out["after" if signalled else "before"] += 1
        if signalled is None and out["before"] >= 3:
            os.kill(pid, signal.SIGTERM)
            signalled = time.monotonic()
            time.sleep(0.3)
            try:  # the proxy takes no new connection once it stops
                socket.create_connection((u.hostname, u.port), timeout=2).close()
                out["refused"] = False
            except OSError:
                out["refused"] = True
            for _ in range(signals - 1):
                time.sleep(0.5)
                os.kill(pid, signal.SIGTERM)
except (OSError, http.client.HTTPException) as e:
    out["error"] = repr(e)
out["seconds_after_signal"] = round(time.monotonic() - signalled, 2) if signalled else None
print(json.dumps(out))
PY
}

# --- 1. one SIGTERM: the answer in flight ends whole, then the supervisor exits 0 ---
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; sup_finish; }
sup_wait 60 'w[0]["state"] == "ready"' || fail "no ready worker: $(sup_status | tr -d '\n' | cut -c1-300)"
SUP_SEGMENTS+=("$(sup_get 's["model"]["segment"]')")
url=$(sup_proxy_url)
out=$(stream_through_stop "$url" "$SUP_PID" 1)
echo "  $out"
get() { python3 -c 'import json, sys; print(json.loads(sys.argv[1]).get(sys.argv[2]))' "$out" "$1"; }
[[ $(get status) == 200 ]] || fail "the stream's status: $(get status)"
(($(get after) > 0)) && pass "tokens kept coming after SIGTERM ($(get before) before, $(get after) after)" \
  || fail "no token after SIGTERM: $out"
[[ $(get done) == True && $(get finish) == length ]] && pass "the answer ended whole: finish_reason length, [DONE]" \
  || fail "the answer was cut: $out"
[[ $(get usage) == *"'completion_tokens': 60"* ]] && pass "usage counts the 60 tokens" || fail "usage: $(get usage)"
[[ $(get refused) == True ]] && pass "no new connection taken while stopping" || fail "a new connection was taken while stopping"
for _ in $(seq 100); do kill -0 "$SUP_PID" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$SUP_PID" 2>/dev/null; then
  fail "the supervisor still runs 10 s after the answer"
else
  wait "$SUP_PID"; rc=$?; SUP_PID=
  [[ $rc == 0 ]] && pass "then it exits 0" || fail "exit status $rc"
fi
grep -q 'finishing the requests in flight' "$SUP_DIR/sup.log" && pass "it logs that it finishes the requests in flight" \
  || fail "no 'finishing the requests in flight' in the log"

# --- 2. a second SIGTERM does not wait for the answer ---
: >"$SUP_DIR/sup.log"
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start again"; sup_finish; }
sup_wait 60 'w[0]["state"] == "ready"' || fail "no ready worker the second time"
url=$(sup_proxy_url)
pid=$SUP_PID
stream_through_stop "$url" "$pid" 2 400 >"$SUP_DIR/second.json" &
client=$!
for _ in $(seq 300); do grep -q 'again: not waiting' "$SUP_DIR/sup.log" && break; sleep 0.1; done
gone=no
for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || { gone=yes; break; }; sleep 0.1; done
wait "$client"
echo "  $(cat "$SUP_DIR/second.json")"
[[ $gone == yes ]] && pass "a second SIGTERM stops it without waiting for the answer" \
  || fail "still running 10 s after the second SIGTERM"
[[ $(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["done"])' "$SUP_DIR/second.json") == False ]] \
  && pass "(that answer is cut: the second signal asked for it)" || fail "the answer finished before the second signal: the case did not happen"
if [[ $gone == yes ]]; then wait "$pid"; SUP_PID=; fi
sup_finish
