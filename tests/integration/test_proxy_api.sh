#!/usr/bin/env bash
# The proxy's APIs with a real worker on stories260K: the official openai and
# @anthropic-ai/sdk clients (tests/js/proxy_clients.mjs), raw SSE framing with
# curl, and the error cases: malformed JSON, wrong types, huge bodies and
# headers, bad keys, unknown paths, prompts over the context, absurd max_tokens,
# max_tokens 0, a body that never ends, malformed chunked bodies, other methods.
# Exit 0 = pass, 1 = fail, 77 = skipped (reason printed).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/proxy_env.sh"
proxy_env_init

echo "sk-test-1" >"$T/keys"
cat >"$T/cfg.yaml" <<EOC
model:
  path: $MODEL
  name: stories
proxy:
  listen: 127.0.0.1:0
  api_keys_file: $T/keys
  limits:
    max_body_bytes: 1MiB
    max_header_bytes: 16KiB
    header_timeout: 2s
    body_timeout: 2s
EOC
start_worker 0 256 2 && wait_worker 0 || exit 1
start_proxy "$T/cfg.yaml" "$T/w0.sock" || exit 1
U=$PROXY_URL
K=(-H "Authorization: Bearer sk-test-1")
for _ in $(seq 50); do [ "$(curl -s -o /dev/null -w '%{http_code}' "$U/health")" = 200 ] && break; sleep 0.1; done

# --- real clients ---
if js_ready; then
  expected=$("$BIN/ds4-worker" run --model "$MODEL" -p "Once upon a time" -n 24 --temp 0 --json 2>/dev/null | jq -r .text)
  if (cd "$SRC/tests/js" && timeout 180 node proxy_clients.mjs "$U" sk-test-1 "$expected"); then
    pass "openai and @anthropic-ai/sdk clients"
  else
    fail "openai and @anthropic-ai/sdk clients"
  fi
else
  echo "note: tests/js/node_modules missing (scripts/test.sh installs it): the SDK checks are skipped"
fi

# --- raw SSE framing ---
curl -sN --max-time 30 "${K[@]}" "$U/v1/chat/completions" \
  -d '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":6,"temperature":0,"stream":true}' -D "$T/h1" >"$T/sse1"
check "SSE: text/event-stream, chunked" grep -qi "content-type: text/event-stream" "$T/h1"
check "SSE: every event is one data: line and a blank line; [DONE] last" \
  python3 - "$T/sse1" <<'PY'
import json, sys
raw = open(sys.argv[1], encoding="utf-8").read()
assert raw.endswith("data: [DONE]\n\n"), raw[-40:]
events = raw.split("\n\n")[:-1]
for e in events:
    lines = e.split("\n")
    assert len(lines) == 1 and lines[0].startswith("data: "), e
    if lines[0] != "data: [DONE]":
        json.loads(lines[0][6:])
chunks = [json.loads(e[6:]) for e in events[:-1]]
assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
assert chunks[-1]["choices"][0]["finish_reason"] == "length"
assert "timings" in chunks[-1]
PY
curl -sN --max-time 30 -H "x-api-key: sk-test-1" "$U/v1/messages" \
  -d '{"model":"x","messages":[{"role":"user","content":"Hi"}],"max_tokens":5,"temperature":0,"stream":true}' >"$T/sse2"
check "SSE: Anthropic event names match their data types, in order" \
  python3 - "$T/sse2" <<'PY'
import json, sys
raw = open(sys.argv[1], encoding="utf-8").read()
events = raw.split("\n\n")[:-1]
names = []
for e in events:
    ev, data = e.split("\n")
    assert ev.startswith("event: ") and data.startswith("data: "), e
    assert json.loads(data[6:])["type"] == ev[7:], e
    if not names or names[-1] != ev[7:]:
        names.append(ev[7:])
assert names == ["message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop",
                 "message_delta", "message_stop"], names
PY

# --- errors ---
code() { curl -s -o "$T/body" -w '%{http_code}' --max-time 30 "$@"; }
check "no key: 401 in OpenAI's shape" \
  bash -c "[ \"\$(curl -s -o $T/b -w '%{http_code}' $U/v1/models)\" = 401 ] && jq -e '.error.type == \"authentication_error\"' $T/b >/dev/null"
check "bad x-api-key on /v1/messages: 401 in Anthropic's shape" \
  bash -c "[ \"\$(curl -s -o $T/b -w '%{http_code}' -H 'x-api-key: nope' $U/v1/messages -d '{}')\" = 401 ] && jq -e '.type == \"error\" and .error.type == \"authentication_error\"' $T/b >/dev/null"
check "unknown path: 404" test "$(code "${K[@]}" "$U/v2/nothing")" = 404
check "malformed JSON: 400" bash -c "[ \"\$(curl -s -o $T/b -w '%{http_code}' -H 'Authorization: Bearer sk-test-1' $U/v1/chat/completions -d '{\"messages\":')\" = 400 ] && jq -e '.error.message | test(\"JSON\")' $T/b >/dev/null"
check "wrong type: 400 naming the field" bash -c "[ \"\$(curl -s -o $T/b -w '%{http_code}' -H 'Authorization: Bearer sk-test-1' $U/v1/chat/completions -d '{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":\"many\"}')\" = 400 ] && jq -e '.error.message | test(\"max_tokens\")' $T/b >/dev/null"
check "n=2: 400 in OpenAI's shape, naming 'n' (only n=1 is served)" bash -c "[ \"\$(curl -s -o $T/b -w '%{http_code}' -H 'Authorization: Bearer sk-test-1' $U/v1/chat/completions -d '{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":2}')\" = 400 ] && jq -e '.error.type == \"invalid_request_error\" and (.error.message | test(\"n.* must be 1\"))' $T/b >/dev/null"
python3 -c "print('[' * 100000 + ']' * 100000)" >"$T/deep.json"
check "deeply nested JSON: 400" test "$(code "${K[@]}" "$U/v1/completions" --data-binary @"$T/deep.json")" = 400
printf '{"prompt":"\xff\xfe bad utf8","max_tokens":3}' >"$T/badutf8.json"
check "invalid UTF-8: an answer, not a crash" bash -c "c=\$(curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer sk-test-1' $U/v1/completions --data-binary @$T/badutf8.json); [ \"\$c\" = 400 ] || [ \"\$c\" = 200 ]"
head -c 100000000 /dev/zero | tr '\0' 'a' >"$T/huge"
check "100 MB body: 413" test "$(code "${K[@]}" "$U/v1/completions" --data-binary @"$T/huge")" = 413
hdrs=()
for i in $(seq 10000); do hdrs+=(-H "X-Junk-$i: x"); done
check "10,000 headers: 431" test "$(code "${K[@]}" "${hdrs[@]}" "$U/health" 2>/dev/null)" = 431
long=$(python3 -c "print('Once upon a time there was a cat. ' * 60)")
check "prompt over the context: 400 naming context and prompt length" \
  bash -c "[ \"\$(curl -s -o $T/b -w '%{http_code}' -H 'Authorization: Bearer sk-test-1' $U/v1/completions -d '{\"prompt\":\"$long\",\"max_tokens\":4}')\" = 400 ] && jq -e '.error.message | test(\"prompt has [0-9]+ tokens but the context is 256\")' $T/b >/dev/null"
check "absurd max_tokens: clamped, answered" \
  bash -c "[ \"\$(curl -s -o $T/b -w '%{http_code}' -H 'Authorization: Bearer sk-test-1' $U/v1/completions -d '{\"prompt\":\"Once\",\"max_tokens\":99999999999}')\" = 200 ] && jq -e '.usage.completion_tokens > 0' $T/b >/dev/null"
# max_tokens 0 ends the job inside the queue's submit, whose caller may then
# let go of it: the proxy must not touch the job after submit returns.
check "max_tokens 0: 200 with no text and the prompt counted, streamed or not; the proxy lives" \
  bash -c "[ \"\$(curl -s -o $T/b -w '%{http_code}' -H 'Authorization: Bearer sk-test-1' $U/v1/completions -d '{\"prompt\":\"Once\",\"max_tokens\":0}')\" = 200 ] &&
    jq -e '.choices[0].text == \"\" and .usage.completion_tokens == 0 and .usage.prompt_tokens > 0' $T/b >/dev/null &&
    curl -sN --max-time 30 -H 'Authorization: Bearer sk-test-1' $U/v1/chat/completions -d '{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_completion_tokens\":0,\"stream\":true}' | tail -c 20 | grep -q 'data: \[DONE\]' &&
    kill -0 \$(cat $T/proxy.pid)"
check "logit_bias is served (+100 on one token: the answer is that token, five times); an unknown tool_choice is a 400 naming it in param" \
  python3 - "$U" <<'PY'
import json, sys, urllib.request, urllib.error
u = sys.argv[1]
def post(path, body):
    req = urllib.request.Request(u + path, json.dumps(body).encode(), {"Authorization": "Bearer sk-test-1"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
base = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
s, plain = post("/v1/completions", base)
s2, forced = post("/v1/completions", dict(base, logit_bias={"300": 100}))
assert s == s2 == 200, (s, s2)
text = forced["choices"][0]["text"]
piece = text[: len(text) // 5]
assert piece and text == piece * 5 and text != plain["choices"][0]["text"], (text, plain)
s, e = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                     "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"})
assert s == 400 and "'tool_choice'" in e["error"]["message"] and e["error"]["param"] == "tool_choice", (s, e)
PY
# The prefix cache shows: a request that repeats a prompt (an agent's next
# turn) reports the tokens its slot already held, in usage and /metrics.
check "prefix cache: a repeated prompt's usage has prompt_tokens_details.cached_tokens (Anthropic: cache_read_input_tokens), and /metrics counts them" \
  python3 - "$U" <<'PY'
import json, sys, urllib.request
u = sys.argv[1]
def post(body):
    req = urllib.request.Request(u + "/v1/completions", json.dumps(body).encode(), {"Authorization": "Bearer sk-test-1"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())
def cached_total():
    with urllib.request.urlopen(u + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("ds4_prompt_tokens_cached_total "):
                return int(float(line.split()[1]))
    raise AssertionError("no ds4_prompt_tokens_cached_total in /metrics")
body = {"prompt": "Lily and Ben went to the park to play with their red ball", "max_tokens": 4, "temperature": 0}
post(body)
before = cached_total()
again = post(body)
n = again["usage"]["prompt_tokens"]
cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
assert cached == n - 1, again["usage"]  # all but the last prompt token, whose logits give the answer
assert cached_total() - before == cached, (before, cached_total(), cached)
# Anthropic's usage splits the prompt: what the cache held, and the rest
# (Claude Code shows both); whole answers and the stream's message_delta.
def post_msg(body):
    req = urllib.request.Request(u + "/v1/messages", json.dumps(body).encode(),
                                 {"x-api-key": "sk-test-1", "anthropic-version": "2023-06-01", "content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()
msg = {"model": "m", "max_tokens": 4, "temperature": 0,
       "messages": [{"role": "user", "content": "Lily and Ben went to the park to play with their red ball"}]}
first = json.loads(post_msg(msg))["usage"]
second = json.loads(post_msg(msg))["usage"]
total = first["input_tokens"] + first["cache_read_input_tokens"]
assert second["input_tokens"] + second["cache_read_input_tokens"] == total, (first, second)
assert second["cache_read_input_tokens"] == total - 1 and second["input_tokens"] == 1, second
assert second["cache_creation_input_tokens"] == 0 and second["output_tokens"] == 4, second
events = [json.loads(l[6:]) for l in post_msg(dict(msg, stream=True)).splitlines() if l.startswith("data: ")]
delta = [e for e in events if e["type"] == "message_delta"][0]["usage"]
assert delta["cache_read_input_tokens"] == total - 1 and delta["input_tokens"] == 1, delta
PY
# What a hostile agent may send: each a clear error in the protocol's shape,
# and the proxy and the worker serve on.
check "agents' hostile input: a 10 MB tools array, too many tools, recursive and too deep schemas, a tool result that is not text, bad strict: clear 4xx naming the field; still serving" \
  python3 - "$U" <<'PY'
import json, sys, urllib.request, urllib.error
u = sys.argv[1]
def post(path, body):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(u + path, data, {"Authorization": "Bearer sk-test-1", "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
user = [{"role": "user", "content": "Weather?"}]
def tool(name, params):
    return {"type": "function", "function": {"name": name, "parameters": params}}
# 10 MB of tools: past max_body_bytes (1MiB here), 413, in each protocol's shape.
big = [tool("f%d" % i, {"type": "object", "description": "x" * 1000}) for i in range(10000)]
s, e = post("/v1/chat/completions", {"messages": user, "tools": big})
assert s == 413 and e["error"]["type"], (s, e)
s, e = post("/v1/messages", {"model": "m", "max_tokens": 8, "messages": user,
                             "tools": [{"name": "f%d" % i, "input_schema": {"type": "object", "description": "x" * 1000}} for i in range(10000)]})
assert s == 413 and e["type"] == "error" and e["error"]["type"], (s, e)
# More tools than the limit, in a body that fits.
s, e = post("/v1/chat/completions", {"messages": user, "tools": [tool("f%d" % i, {"type": "object"}) for i in range(1100)]})
assert s == 400 and "more than" in e["error"]["message"] and e["error"]["param"] == "tools", (s, e)
# Schemas: a $ref to itself, and nesting past the limit, under a forced call.
for params, says in [({"$ref": "#"}, "$ref cycle"),
                     ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}, "$ref cycle")]:
    s, e = post("/v1/chat/completions", {"messages": user, "tools": [tool("f", params)], "tool_choice": "required", "max_tokens": 8})
    assert s == 400 and says in e["error"]["message"] and e["error"]["param"] == "tools[0].function.parameters", (s, e)
deep = json.loads('{"type":"object","properties":{"a":' * 100 + '{"type":"integer"}' + '}}' * 100)
s, e = post("/v1/chat/completions", {"messages": user, "tools": [tool("f", deep)], "tool_choice": "required", "max_tokens": 8})
assert s == 400 and "nests deeper than" in e["error"]["message"], (s, e)
# A tool result that is not text; strict that is not a boolean.
hist = user + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
               "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": {"temp": 21}}]
s, e = post("/v1/chat/completions", {"messages": hist, "tools": [tool("f", {"type": "object"})], "max_tokens": 4})
assert s == 400 and e["error"]["param"] == "messages[2].content", (s, e)
s, e = post("/v1/chat/completions", {"messages": user, "tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]})
assert s == 400 and e["error"]["param"] == "tools[0].function.strict", (s, e)
# Still serving (this worker's context is 256 tokens: a short question).
s, r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
assert s == 200 and r["usage"]["completion_tokens"] > 0, (s, r)
PY
# HTTP-level answers: a body that stops coming, a malformed chunked body, a
# body too large on Anthropic's path, other methods, HEAD.
check "HTTP: a late body gets 408 after body_timeout; a bad chunk 400; 413 in Anthropic's shape on /v1/messages; 405 with Allow; HEAD's length" \
  python3 - "${U#http://}" <<'PY'
import json, socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
def exchange(raw, wait=10):
    s = socket.create_connection((host, int(port)), timeout=wait)
    s.sendall(raw)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
    return int(lines[0].split()[1]), headers, body
key = b"Authorization: Bearer sk-test-1\r\n"
start = time.monotonic()
status, h, body = exchange(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + key + b"Content-Length: 100\r\n\r\n{\"prompt\":")
took = time.monotonic() - start
assert status == 408 and "body_timeout" in json.loads(body)["error"]["message"], (status, body)
assert 1.5 < took < 6, took
status, h, body = exchange(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + key +
                           b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n")
assert status == 400 and json.loads(body)["error"]["message"].startswith("malformed HTTP request body"), (status, body)
status, h, body = exchange(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: sk-test-1\r\nContent-Length: 99999999\r\n\r\n")
assert status == 413 and json.loads(body)["type"] == "error", (status, body)
status, h, body = exchange(b"PUT /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + key + b"\r\n")
assert status == 405 and h.get("allow") == "GET, HEAD, OPTIONS", (status, h)
_, get_h, get_body = exchange(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + key + b"\r\n")
status, h, body = exchange(b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + key + b"\r\n")
assert status == 200 and body == b"" and int(h["content-length"]) == len(get_body) > 0, (status, h, body)
PY
# Bodies of 16 KiB or more are parsed and tokenized off the io thread (the
# planner): the same answers, errors and keys as short ones.
check "a long body (a request padded to 40 KB): the same answer as without the padding, streamed or not" \
  python3 - "$U" <<'PY'
import json, sys, urllib.request, urllib.error
u = sys.argv[1]
def post(body, key="sk-test-1"):
    req = urllib.request.Request(u + "/v1/completions", body.encode(), {"Authorization": "Bearer " + key})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
for stream in (False, True):
    short = json.dumps({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "stream": stream})
    padded = "{" + " " * 40000 + short[1:]
    s1, a = post(short)
    s2, b = post(padded)
    assert s1 == s2 == 200, (s1, s2, b[:200])
    text = lambda t: json.loads(t)["choices"][0]["text"] if not stream else "".join(
        json.loads(l[6:])["choices"][0]["text"] for l in t.split("\n") if l.startswith("data: {"))
    assert text(a) == text(b) and text(a), (a[:200], b[:200])
bad = post("{" + " " * 40000 + '"prompt": 5}')
assert bad[0] == 400 and "prompt" in json.loads(bad[1])["error"]["message"], bad
assert post("{" + " " * 40000 + '"prompt": "x"}', key="nope")[0] == 401
long = json.dumps({"prompt": "Once upon a time there was a cat. " * 600, "max_tokens": 4})
s, b = post(long)
assert s == 400 and "but the context is 256" in json.loads(b)["error"]["message"], (s, b[:200])
PY
# A slowloris client: headers trickle in; the header timeout (2 s) closes it.
start=$(date +%s)
( printf 'POST /v1/completions HTTP/1.1\r\nHost: x\r\n'; for i in $(seq 8); do printf 'X-Slow: %d\r\n' "$i"; sleep 1; done ) |
  timeout 20 curl -s telnet://"${U#http://}" >/dev/null 2>&1
took=$(( $(date +%s) - start ))
check "slowloris: cut off by the header timeout (${took}s)" test "$took" -le 6
check "still serving after all that" test "$(code "${K[@]}" "$U/v1/completions" -d '{"prompt":"Once","max_tokens":2}')" = 200
check "pipelined requests (POST, POST, GET in one write on one connection): three answers, in order" \
  python3 - "${U#http://}" <<'PY'
import json, socket, sys
host, port = sys.argv[1].rsplit(":", 1)
def post(prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test-1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
s = socket.create_connection((host, int(port)), timeout=10)
s.sendall(post("Once") + post("The cat") + b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test-1\r\n\r\n")
f = s.makefile("rb")
answers = []
for _ in range(3):
    status = f.readline().split()[1]
    length = None
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    answers.append((status, json.loads(f.read(length))))
assert [a[0] for a in answers] == [b"200"] * 3, answers
assert answers[0][1]["object"] == "text_completion" and answers[1][1]["object"] == "text_completion", answers
assert answers[2][1]["object"] == "list", answers
PY
# Keys reload on SIGHUP.
echo "sk-test-2" >"$T/keys"
kill -HUP "$(cat "$T/proxy.pid")"
sleep 0.3
check "SIGHUP reloads the keys" bash -c "[ \"\$(curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer sk-test-2' $U/v1/models)\" = 200 ] && [ \"\$(curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer sk-test-1' $U/v1/models)\" = 401 ]"
check "/metrics counts answers by status and shows the worker" \
  bash -c "curl -s $U/metrics | grep -q 'ds4_http_requests_total{code=\"401\"}' && curl -s $U/metrics | grep -q 'ds4_worker_context{worker=\"0\"} 256' && curl -s $U/metrics | grep -q 'ds4_worker_host_expert_layers{worker=\"0\"} 0'"
check "the proxy is still running" kill -0 "$(cat "$T/proxy.pid")"
# SIGTERM: stops accepting, finishes what runs, exits 0.
curl -sN --max-time 30 -H "Authorization: Bearer sk-test-2" "$U/v1/completions" \
  -d '{"prompt":"Once","max_tokens":200,"stream":true}' >"$T/last" &
# In flight: its stream has begun (a fixed sleep lost the race on a busy machine).
for _ in $(seq 200); do grep -q '^data: ' "$T/last" 2>/dev/null && break; sleep 0.025; done
kill -TERM "$(cat "$T/proxy.pid")"
stopped=no
for _ in $(seq 100); do kill -0 "$(cat "$T/proxy.pid")" 2>/dev/null || { stopped=yes; break; }; sleep 0.1; done
check "SIGTERM stops the proxy within 10 s" test "$stopped" = yes
wait
check "the request in flight at SIGTERM finished" bash -c "tail -c 20 $T/last | grep -q 'data: \[DONE\]'"

[ "$fails" = 0 ] && echo "all passed" || echo "$fails failed"
[ "$fails" = 0 ]
