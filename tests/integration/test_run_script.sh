#!/usr/bin/env bash
# The newcomer's path: scripts/run.sh (the README's quick start) serves, and
# the address it prints answers GET /health (200 once a worker is ready) and
# GET /status (the page) and /status.json. It runs in the checkout under test
# (in CI a fresh clone, built by scripts/test.sh just before; run.sh builds
# only what is missing), with a config on a free port so that it never meets
# another server's. DS4_RUN_FRESH_CLONE=1 clones the committed tree first and
# measures the whole first run there (about 6.5 minutes on 2 idle cores).
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
: "${DS4_SRC:?}" "${DS4_BIN:?}"
. "$(dirname "${BASH_SOURCE[0]}")/lib/supervisor_env.sh"   # pass, fail, sup_wait_health
model=${DS4_MODELS:-$DS4_SRC/../shared/models}/stories260K.gguf
[[ -f $model ]] || { echo "SKIP: no $model"; exit 77; }
command -v curl >/dev/null || { echo "SKIP: no curl"; exit 77; }

T=$(mktemp -d /tmp/ds4-run-test.XXXXXX)
src=$DS4_SRC
if [[ ${DS4_RUN_FRESH_CLONE:-0} == 1 ]]; then
  git clone -q "$DS4_SRC" "$T/clone" || { echo "FAIL - git clone"; exit 1; }
  ln -s "$(cd "$DS4_SRC/.." && pwd)/shared" "$T/shared" 2>/dev/null
  src=$T/clone
fi
export XDG_RUNTIME_DIR=$T/run   # a private runtime folder: no user manager, child-process workers
mkdir -p -m 0700 "$XDG_RUNTIME_DIR"
cat >"$T/ds4.yaml" <<YAML
model:
  path: $model
  name: stories
proxy:
  listen: 127.0.0.1:0         # any free port: the address comes from what run.sh prints
workers:
  threads: 1
YAML
pid=
cleanup() {
  SUP_PID=$pid
  sup_stop   # TERM, at most 15 s, then KILL
  [[ ${fails} == 0 ]] && rm -rf "$T" || echo "kept $T"
}
trap cleanup EXIT

start=$SECONDS
(cd "$src" && exec scripts/run.sh "$T/ds4.yaml") >"$T/run.log" 2>&1 &
pid=$!
url=
limit=${DS4_RUN_LIMIT_S:-480}   # a first build of the service's binaries takes ~6.5 min on 2 idle cores
while ((SECONDS - start < limit)); do
  url=$(sed -n 's/.*proxy listening on [^ ]* (OpenAI and Anthropic APIs at \(http:[^ ]*\)\/v1.*/\1/p' "$T/run.log" | head -1)
  [[ -n $url ]] && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.2
done
if [[ -z $url ]]; then
  fail "run.sh printed no address within $limit s; its log:"
  tail -20 "$T/run.log"
  exit 1
fi
pass "run.sh printed its address after $((SECONDS - start)) s: $url"
grep -q "the status page at $url/status" "$T/run.log" && pass "and the status page's: $url/status" || fail "no status page address printed"
sup_wait_health "$url" 600 && pass "GET $url/health: 200 after $((SECONDS - start)) s" || fail "GET /health: $code"
page=$(curl -s --max-time 5 -w '\n%{http_code}' "$url/status")
[[ ${page##*$'\n'} == 200 && $page == *'<title>ds4 status</title>'* ]] && pass "GET $url/status: the page" || fail "GET /status: ${page: -200}"
curl -s --max-time 5 "$url/status.json" | python3 -c 'import json,sys; s=json.load(sys.stdin); assert s["workers"][0]["state"]=="ready"' \
  && pass "GET $url/status.json: worker 0 ready" || fail "GET /status.json"
reply=$(curl -s --max-time 30 "$url/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"messages":[{"role":"user","content":"Once upon a time"}],"max_tokens":10}')
[[ $reply == *'"choices"'* ]] && pass "the README's chat completion answers" || fail "chat completion: ${reply:0:300}"
((fails)) && { echo "$fails failure(s)"; tail -20 "$T/run.log"; exit 1; }
echo "all passed"
