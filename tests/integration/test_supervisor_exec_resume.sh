#!/usr/bin/env bash
# Zero loss with an external engine: the real llama-server (the peer,
# ../shared/peers/llama.cpp) as the exec worker, one slot (-np 1: its answers
# do not depend on batching), stories260K. 8 clients send 120 greedy requests
# of up to 300 tokens (completions and chat, streamed and not, and Anthropic
# message streams) through the official openai and Anthropic SDKs, first undisturbed, then while llama-server is
# SIGKILLed 3 times mid-run. Required: 0 failed, every answer (text, finish,
# completion_tokens; chat streams token by token) equal to the undisturbed
# run's, and streams cut mid-answer resumed on the restarted engine (the
# proxy probed it: "resumes ... completions and chat"), not ended with an
# error event. Without resume (before issue 23) about 1 in 160 requests failed.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"
source "$here/lib/peer.sh"
peer_require
[[ -d $DS4_SRC/tests/js/node_modules/openai ]] || { echo "SKIP: tests/js/node_modules (openai) not installed"; exit 77; }
sup_begin curl jq node
T=$SUP_DIR
# Ports: the proxy and the engines in a range of their own (DS4_EXEC_PORTS).
base=${DS4_TEST_PORT_BASE:-18700}
export DS4_EXEC_PORTS="$((base + 10))-$((base + 49))"
cat >"$T/ds4.yaml" <<YAML
model:
  path: $model
  name: stories
proxy:
  listen: 127.0.0.1:$((base + 1))
workers:
  backend: process
  slots: 1
  context:
    ladder: [4096]
  reserve: 64MiB
  engine: exec
  exec:
    command: "$peer_bin/llama-server -m {model} --host 127.0.0.1 --port {port} -c {ctx} -np {slots} -t 1 --jinja --no-webui"
headroom:
  min_available: 64MiB
  step_up_after: 0
YAML
sup_start "$T/ds4.yaml" || { fail "the supervisor did not start"; sup_finish; }
sup_wait 120 'w[0]["state"] == "ready"' || { fail "llama-server not ready: $(sup_status | tr -d '\n' | cut -c1-400)"; sup_finish; }
U=$(sup_proxy_url)
[[ -n $U ]] || { fail "no proxy address in the log"; sup_finish; }
for _ in $(seq 100); do
  grep -aq 'resumes answers cut mid-stream' "$T/sup.log" && break
  sleep 0.1
done
if grep -aq 'resumes answers cut mid-stream: completions and chat' "$T/sup.log"; then
  pass "the proxy probed llama-server: $(grep -a -m1 -o 'resumes answers cut mid-stream: .*' "$T/sup.log" | cut -c1-80)"
else
  fail "no probe result 'completions and chat' in the log: $(grep -a -m1 'resumes answers' "$T/sup.log")"
fi
metric() { curl -s --max-time 5 "$U/metrics" | awk -v n="$1" '$1 == n { print $2 }'; }

engine_pid() {
  local w
  w=$(sup_get 'w[0]["pid"] if w[0]["state"] == "ready" else ""')
  [[ -n $w ]] && pgrep -P "$w" -x llama-server
}
text_of() {  # an SSE file's text: completions' text, chat's content or Anthropic's text deltas, in order
  sed -n 's/^data: //p' "$1" | grep -v '^\[DONE\]' |
    jq -j 'if .type then (select(.type == "content_block_delta") | .delta.text // "") else .choices[0] | (.text // .delta.content // "") end'
}
usage_of() {  # the last usage figures of an SSE file (chat/completions usage, Anthropic's message_delta)
  sed -n 's/^data: //p' "$1" | grep -v DONE |
    jq -c 'if .type then (select(.type == "message_delta") | .usage | {output_tokens, prompt: (.input_tokens + .cache_read_input_tokens)})
           else (select(.usage) | .usage | {completion_tokens, prompt_tokens}) end' | tail -1
}
# ---- one long stream cut mid-answer, for each API: it goes on, same text ----
for api in completions chat anthropic; do
  # Chat is cut late: its answer has a BOS (id 1, no text) near token 467,
  # a token whose event llama-server's chat stream leaves out, so the resume
  # must ask the engine for the id it never saw. Anthropic's stream goes to
  # the engine as chat (engine_anthropic.h), cut at the same place.
  if [[ $api == completions ]]; then path=/v1/completions body='"prompt":"Once upon a time"' cut_at=20
  elif [[ $api == chat ]]; then path=/v1/chat/completions body='"messages":[{"role":"user","content":"Tell me a story."}]' cut_at=600
  else path=/v1/messages body='"model":"stories","messages":[{"role":"user","content":"Tell me a story."}]' cut_at=600; fi
  req="{$body,\"max_tokens\":1500,\"temperature\":0,\"ignore_eos\":true,\"stream\":true}"
  # llama-server reuses a cached prompt prefix, and its numbers depend on the
  # batch that computed it: after the last cut's continuation (~600 tokens
  # at once) the undisturbed Anthropic answer parted from the chat one at a
  # near tie right after the BOS. A fresh engine first, so that the
  # undisturbed answer and the cut one start from the same cache.
  kill -9 "$(engine_pid)"
  sup_wait 60 'w[0]["state"] == "ready"'
  curl -sN --max-time 120 "$U$path" -H 'content-type: application/json' -d "$req" >"$T/$api.ref"
  sup_wait 60 'w[0]["state"] == "ready"'
  curl -sN --max-time 120 "$U$path" -H 'content-type: application/json' -d "$req" >"$T/$api.cut" &
  client=$!
  for _ in $(seq 400); do [[ $(grep -c '^data: {' "$T/$api.cut" 2>/dev/null) -ge $cut_at ]] && break; sleep 0.01; done
  e=$(engine_pid)
  got_before=$(grep -c '^data: {' "$T/$api.cut")
  kill -9 "$e"
  wait "$client"
  ref_text=$(text_of "$T/$api.ref") cut_text=$(text_of "$T/$api.cut")
  if grep -q '"error"' "$T/$api.cut"; then fail "$api: the cut stream has an error event: $(grep -m1 error "$T/$api.cut" | cut -c1-200)"
  elif [[ $cut_text == "$ref_text" && -n $ref_text ]]; then
    pass "$api: a stream cut by SIGKILL of llama-server (pid $e) after $got_before events went on, its text equal to the undisturbed one (${#ref_text} bytes)"
  else
    at=$(cmp <(printf %s "$ref_text") <(printf %s "$cut_text") 2>/dev/null | awk '{print $5}' | tr -d ,)
    fail "$api: the cut stream's text differs from the undisturbed one (cut after $got_before events; ${#cut_text} against ${#ref_text} bytes, first difference at byte ${at:-?}: '${cut_text:$(( ${at:-1} - 1 )):40}' against '${ref_text:$(( ${at:-1} - 1 )):40}')"
  fi
  end_mark='^data: \[DONE\]'; [[ $api == anthropic ]] && end_mark='^event: message_stop'
  if grep -q "$end_mark" "$T/$api.cut"; then pass "$api: the cut stream ends as a whole one ($end_mark)"; else fail "$api: no $end_mark at the end of the cut stream"; fi
  u_ref=$(usage_of "$T/$api.ref") u_cut=$(usage_of "$T/$api.cut")
  if [[ $u_ref == "$u_cut" ]]; then pass "$api: usage as undisturbed (${u_ref:-none})"; else fail "$api: usage $u_cut, undisturbed $u_ref"; fi
done
sup_wait 60 'w[0]["state"] == "ready"'
check_log() { if grep -aq "$1" "$T/sup.log"; then fail "$2: $(grep -m1 "$1" "$T/sup.log" | cut -c1-200)"; else pass "no $2"; fi; }
check_log 'failed after its first byte\|failed mid-answer' "stream ended in an error"

kinds=completion_stream,chat_stream,completion,chat,messages_stream
cd "$DS4_SRC/tests/js" || exit 1
echo "undisturbed run:"
# pipefail: the load's own verdict, not tee's, decides.
set -o pipefail
timeout 400 node proxy_load.mjs --base "$U" --requests 120 --concurrency 8 --max-tokens 300 --kinds $kinds \
  --out "$T/ref.json" | tee "$T/ref.summary" || { fail "the undisturbed run"; sup_finish; }
streamed_tokens=$(jq '[.[] | select(.kind | endswith("stream")) | .completion_tokens] | add' "$T/ref.json")
echo "   streamed answers: $streamed_tokens tokens in all"

echo 0 >"$T/faults"
cat >"$T/fault.sh" <<EOS
#!/usr/bin/env bash
export XDG_RUNTIME_DIR=$XDG_RUNTIME_DIR
n=\$((\$(cat $T/faults) + 1)); echo \$n >$T/faults
for _ in \$(seq 300); do
  w=\$("$DS4_BIN/ds4ctl" status --json 2>/dev/null | jq -r 'if .workers[0].state == "ready" then .workers[0].pid else empty end')
  e=\${w:+\$(pgrep -P "\$w" -x llama-server)}
  [[ -n \$e ]] && break
  sleep 0.05
done
sleep 0.\$((RANDOM % 3))\$((RANDOM % 10))
echo "fault \$n: kill -9 llama-server \$e (worker \$w)" >>$T/faults.log
kill -9 "\$e"
EOS
chmod +x "$T/fault.sh"
resumes_before=$(metric ds4_resumes_total)
echo "run with 3 SIGKILLs of llama-server:"
if timeout 400 node proxy_load.mjs --base "$U" --requests 120 --concurrency 8 --max-tokens 300 --kinds $kinds \
     --reference "$T/ref.json" --fault-cmd "$T/fault.sh" --faults 3 | tee "$T/summary"; then
  pass "0 failed, every answer equal to the undisturbed run"
else
  fail "zero loss under 3 SIGKILLs of llama-server"
fi
sed 's/^/     /' "$T/faults.log"
resumed=$(( $(metric ds4_resumes_total) - ${resumes_before:-0} ))
echo "proxy: $resumed requests moved to the restarted engine (mid-answer or before it), largest pause a streaming client saw: $(head -1 "$T/summary" | jq .largest_stream_pause_ms) ms"
mid=$(grep -ac 'continuing an answer after' "$T/sup.log")
check() { local what=$1; shift; if "$@"; then pass "$what"; else fail "$what"; fi; }
check "3 faults ran" test "$(cat "$T/faults")" = 3
check "the supervisor restarted the engine 9 times: 3 fresh starts + 3 cuts + 3 faults (restarts $(sup_get 'w[0]["restarts"]'))" test "$(sup_get 'w[0]["restarts"]')" = 9
if grep -aq 'failed after its first byte\|failed mid-answer' "$T/sup.log"; then fail "a stream ended in an error: $(grep -m1 'mid-answer\|first byte' "$T/sup.log")"; else pass "no stream ended in an error event"; fi
echo "   streams continued mid-answer (the log's debug lines, if shown): $mid"
check "the supervisor is still running" kill -0 "$SUP_PID"
# The keeper restarts a supervisor that died of a signal (a crash): the port
# stays, but every answer in flight is lost and the counters start again.
# A crash's report (shared/crash_report.h), frames resolved where addr2line is.
crash_report() {
  grep -a -A 40 'ds4-supervisor: crashed' "$T/sup.log" | grep -a 'crashed\|(+0x' | head -40 | while read -r line; do
    off=$(grep -o 'ds4-supervisor(+0x[0-9a-f]*)' <<<"$line" | grep -o '0x[0-9a-f]*')
    echo "     $line${off:+  $(addr2line -f -C -e "$DS4_BIN/ds4-supervisor" "$off" 2>/dev/null | paste -sd' ' | cut -c1-160)}"
  done
}
if grep -aq 'DS4_EVENT=supervisor_restart' "$T/sup.log"; then
  fail "the supervisor crashed and its keeper started it again: $(grep -a -m1 'DS4_EVENT=supervisor_restart' "$T/sup.log" | cut -c1-240)"
  crash_report
else
  pass "the supervisor never crashed (no keeper restart in its log)"
fi
# ---- the supervisor itself SIGKILLed under load; its keeper starts it again ----
# A request that had not reached the engine yet, or waited in the queue, is
# read again from the connection the new supervisor adopts and goes to the
# new engine: an exec engine's request although no engine is back yet (it
# used to be planned for a ds4 worker and wait until the client gave up). An
# exec engine's answer already under way goes on from the stream the journal
# kept (DS4_EVENT=answer_restored): the new engine continues it from its last
# token, as when an engine dies (it used to be closed). None may hang, fail
# or change.
adopted_before=$(grep -ac 'DS4_EVENT=connections_adopted' "$T/sup.log")
lost_before=$(grep -ac 'DS4_EVENT=connection_lost' "$T/sup.log")
restored_before=$(grep -ac 'DS4_EVENT=answer_restored' "$T/sup.log")
sup_restarts_before=$(grep -ac 'DS4_EVENT=supervisor_restart' "$T/sup.log")
cat >"$T/kill_sup.sh" <<EOS
#!/usr/bin/env bash
pid=\$(pgrep -P $SUP_PID -x ds4-supervisor)
echo "kill -9 supervisor \$pid (under its keeper $SUP_PID)" >>$T/faults.log
kill -9 "\$pid"
EOS
chmod +x "$T/kill_sup.sh"
echo "run with 1 SIGKILL of the supervisor:"
timeout 300 node proxy_load.mjs --base "$U" --requests 120 --concurrency 8 --max-tokens 300 --kinds $kinds \
  --reference "$T/ref.json" --fault-cmd "$T/kill_sup.sh" --faults 1 --timeout-ms 60000 >"$T/summary_sup"
head -1 "$T/summary_sup"
sup_wait 60 'w[0]["state"] == "ready"' || fail "no worker ready after the supervisor's restart"
adopted=$(( $(grep -ac 'DS4_EVENT=connections_adopted' "$T/sup.log") - adopted_before ))
lost=$(( $(grep -ac 'DS4_EVENT=connection_lost' "$T/sup.log") - lost_before ))
failed=$(head -1 "$T/summary_sup" | jq .failed) mismatches=$(head -1 "$T/summary_sup" | jq .mismatches)
timeouts=$(grep -c 'timed out' "$T/summary_sup")
check "the keeper started the supervisor again and it took back the connections, once ($adopted times: $(grep -a 'DS4_EVENT=connections_adopted' "$T/sup.log" | tail -1 | grep -o 'took back [^(]*' | head -1))" test "$adopted" = 1
# Only the one SIGKILL: a second start would be a crash of the restarted supervisor.
restarts=$(( $(grep -ac 'DS4_EVENT=supervisor_restart' "$T/sup.log") - sup_restarts_before ))
if [ "$restarts" != 1 ]; then
  fail "the keeper started the supervisor $restarts times for one SIGKILL:"
  grep -a 'DS4_EVENT=supervisor_restart' "$T/sup.log" | cut -c1-240 | sed 's/^/     /'
  crash_report
else
  pass "the restarted supervisor did not crash"
fi
check "no request hung after the supervisor's restart (client timeouts: $timeouts)" test "$timeouts" = 0
restored=$(( $(grep -ac 'DS4_EVENT=answer_restored' "$T/sup.log") - restored_before ))
check "no request failed and none changed ($failed failed, $mismatches changed, $lost connections closed)" \
  test "$failed" = 0 -a "$mismatches" = 0 -a "$lost" = 0
check "answers under way went on from the journal after the restart ($restored of them)" test "$restored" -ge 1
sup_finish
