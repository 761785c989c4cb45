#!/usr/bin/env bash
# The proxy's queue with a real worker on stories260K: requests sent while no
# worker is ready wait (streams see ": waiting, position N") and complete once
# one is; a full queue answers 503 with Retry-After; a queued client that
# disconnects frees its place; queue.max_wait gives each protocol's timeout
# error (504, or an error event on a stream that already began).
# Exit 0 = pass, 1 = fail, 77 = skipped (reason printed).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/proxy_env.sh"
proxy_env_init

cat >"$T/cfg.yaml" <<EOC
model:
  path: $MODEL
proxy:
  listen: 127.0.0.1:0
  queue:
    max_waiting: 4
    max_wait: 60s
EOC
# No worker yet: the socket path is known, nothing listens there.
start_proxy "$T/cfg.yaml" "$T/w0.sock" || exit 1
U=$PROXY_URL
check "/health is 503 while no worker is ready" test "$(curl -s -o /dev/null -w '%{http_code}' "$U/health")" = 503

req='{"prompt":"Once upon a time","max_tokens":12,"temperature":0}'
timeout 60 curl -sN "$U/v1/chat/completions" -d '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":8,"temperature":0,"stream":true}' >"$T/q0" &
PIDS+=($!)
sleep 0.3
for i in 1 2; do
  timeout 60 curl -s -o "$T/q$i" -w '%{http_code}' "$U/v1/completions" -d "$req" >"$T/q$i.code" &
  PIDS+=($!)
done
timeout 60 curl -s "$U/v1/completions" -d "$req" >/dev/null &
leaver=$!
check "four requests wait in the queue" wait_metric ds4_queue_waiting 4
code=$(curl -s -D "$T/h503" -o "$T/b503" -w '%{http_code}' --max-time 10 "$U/v1/completions" -d "$req")
check "a full queue answers 503" test "$code" = 503
check "503 carries Retry-After" grep -qi '^retry-after: [0-9]' "$T/h503"
check "503 in OpenAI's error shape" bash -c "jq -e '.error.message | test(\"queue is full\")' $T/b503 >/dev/null"
code=$(curl -s -o "$T/b503a" -w '%{http_code}' --max-time 10 "$U/v1/messages" -d '{"model":"x","max_tokens":4,"messages":[{"role":"user","content":"Hi"}]}')
check "503 in Anthropic's error shape" bash -c "[ $code = 503 ] && jq -e '.type == \"error\" and .error.type == \"overloaded_error\"' $T/b503a >/dev/null"
kill "$leaver" 2>/dev/null
check "a queued client that disconnects frees its place" wait_metric ds4_queue_waiting 3
timeout 60 curl -s -o "$T/q3" -w '%{http_code}' "$U/v1/completions" -d "$req" >"$T/q3.code" &
PIDS+=($!)
check "… which the next request takes" wait_metric ds4_queue_waiting 4
check "the waiting stream shows its position in SSE comments" grep -q '^: waiting, position 1' "$T/q0"

start_worker 0 256 2
wait_worker 0 || exit 1
for _ in $(seq 100); do [ "$(metric ds4_queue_waiting)" = 0 ] && [ "$(metric ds4_requests_in_flight)" = 0 ] && break; sleep 0.1; done
sleep 0.2
expected=$("$BIN/ds4-worker" run --model "$MODEL" -p "Once upon a time" -n 12 --temp 0 --json 2>/dev/null | jq -r .text)
for i in 1 2 3; do
  check "queued request $i completes once a worker is ready" \
    bash -c "[ \"\$(cat $T/q$i.code)\" = 200 ] && [ \"\$(jq -r '.choices[0].text' $T/q$i)\" = \"\$1\" ]" _ "$expected"
done
check "the queued stream completes" bash -c "tail -c 20 $T/q0 | grep -q 'data: \[DONE\]'"
check "the disconnected request was never dispatched (4 of the 5 went to the worker)" \
  test "$(metric ds4_queue_wait_seconds_count)" = 4
stop_proxy

# max_wait: a proxy whose worker never comes.
cat >"$T/cfg2.yaml" <<EOC
model:
  path: $MODEL
proxy:
  listen: 127.0.0.1:0
  queue:
    max_wait: 1s
EOC
start_proxy "$T/cfg2.yaml" "$T/none.sock" || exit 1
U=$PROXY_URL
code=$(curl -s -o "$T/t1" -w '%{http_code}' --max-time 20 "$U/v1/completions" -d "$req")
check "max_wait: 504 in OpenAI's shape" bash -c "[ $code = 504 ] && jq -e '.error.type == \"timeout_error\"' $T/t1 >/dev/null"
code=$(curl -s -o "$T/t2" -w '%{http_code}' --max-time 20 "$U/v1/messages" -d '{"model":"x","max_tokens":4,"messages":[{"role":"user","content":"Hi"}]}')
check "max_wait: 504 in Anthropic's shape" bash -c "[ $code = 504 ] && jq -e '.type == \"error\" and .error.type == \"timeout_error\"' $T/t2 >/dev/null"
curl -sN --max-time 20 "$U/v1/chat/completions" -d '{"messages":[{"role":"user","content":"Hi"}],"stream":true}' >"$T/t3"
check "max_wait on a stream: waiting comments, then an error event" \
  bash -c "grep -q '^: waiting' $T/t3 && grep -q '^data: {\"error\"' $T/t3"
check "timeouts are counted" test "$(metric ds4_queue_timeouts_total)" = 3

[ "$fails" = 0 ] && echo "all passed" || echo "$fails failed"
[ "$fails" = 0 ]
