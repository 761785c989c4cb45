#!/usr/bin/env bash
# Zero loss under faults: 8 concurrent clients send 300 requests (half
# streamed, greedy, max_tokens 48) through the official SDKs, first
# undisturbed, then while the worker is SIGKILLed 3 times and restarted on the
# same socket. Required: 0 failed requests, every answer identical to the
# undisturbed run's (streams token by token: no gap, no repeat). Prints the
# largest pause a streaming client saw.
# Exit 0 = pass, 1 = fail, 77 = skipped (reason printed).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/proxy_env.sh"
proxy_env_init
js_ready || { echo "SKIP: tests/js/node_modules (openai, @anthropic-ai/sdk) not installed"; exit 77; }

cat >"$T/cfg.yaml" <<EOC
model:
  path: $MODEL
proxy:
  listen: 127.0.0.1:0
EOC
start_worker 0 256 4 && wait_worker 0 || exit 1
start_proxy "$T/cfg.yaml" "$T/w0.sock" || exit 1
for _ in $(seq 50); do [ "$(curl -s -o /dev/null -w '%{http_code}' "$PROXY_URL/health")" = 200 ] && break; sleep 0.1; done

# Kill at a random moment (0-40 ms later), restart on the same socket at once.
cat >"$T/fault.sh" <<EOS
#!/usr/bin/env bash
sleep 0.0\$((RANDOM % 4))\$((RANDOM % 10))
kill -9 \$(cat $T/w0.pid)
"$BIN/ds4-worker" serve --model "$MODEL" --socket "$T/w0.sock" --id 0 --context 256 --slots 4 --threads 1 >>"$T/w0.log" 2>&1 &
echo \$! >$T/w0.pid
EOS
chmod +x "$T/fault.sh"

cd "$SRC/tests/js" || exit 1
echo "undisturbed run:"
timeout 300 node proxy_load.mjs --base "$PROXY_URL" --requests 300 --concurrency 8 --max-tokens 48 --out "$T/ref.json" ||
  { fail "the undisturbed run"; exit 1; }
echo "run with 3 SIGKILLs of the worker:"
if timeout 300 node proxy_load.mjs --base "$PROXY_URL" --requests 300 --concurrency 8 --max-tokens 48 \
     --reference "$T/ref.json" --fault-cmd "$T/fault.sh" --faults 3 | tee "$T/summary"; then
  pass "0 failures, every answer identical to the undisturbed run"
else
  fail "zero loss under SIGKILL"
fi
echo "largest pause a streaming client saw: $(head -1 "$T/summary" | jq .largest_stream_pause_ms) ms"
echo "proxy: $(metric ds4_resumes_total) requests resumed on the restarted worker mid-answer, $(metric ds4_worker_calls_broken_total) worker connections broken, $(metric 'ds4_worker_restarts_total{worker="0"}') restarts seen"
check "requests were resumed mid-answer" test "$(metric ds4_resumes_total)" -ge 1
check "the proxy is still running" kill -0 "$(cat "$T/proxy.pid")"

[ "$fails" = 0 ] && echo "all passed" || echo "$fails failed"
[ "$fails" = 0 ]
