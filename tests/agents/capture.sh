#!/usr/bin/env bash
# Captures what each agent CLI sends: runs it for one turn against
# tests/tools/capture_server.mjs and writes every request it made to
# tests/data/agent_requests/<client>-N.json (N = 1, 2, ... in the order sent;
# secrets redacted, nothing else trimmed). Those files are the fixtures the
# ds4 proxy must accept.
#   tests/agents/capture.sh [--tools] [PORT (19401)] [CLIENT...]
# --tools: the server answers the turn's first request with a call of the
# client's read tool (or shell: cat) on DIR/work/hello.txt, so the client
# sends the call and its result back; written as <client>-tools-N.json.
# Needs tests/agents/node_modules (npm install there). The old fixtures of a
# client are replaced only when its run succeeds.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=$(cd "$here/../.." && pwd)
. "$here/clients.sh"
tools=0
if [[ ${1:-} == --tools ]]; then tools=1; shift; fi
port=${1:-19401}
shift || true
clients=("$@")
((${#clients[@]})) || clients=("${AGENT_CLIENTS[@]}")
why=$(agent_check) || { echo "capture.sh: $why" >&2; exit 1; }

tmp=$(mktemp -d /tmp/ds4-capture.XXXXXX)
server=
cleanup() {
  [[ -n $server ]] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT

out_dir=$src/tests/data/agent_requests
mkdir -p "$out_dir"
status=0
for c in "${clients[@]}"; do
  mkdir -p "$tmp/$c/work"
  echo "hello from the capture" >"$tmp/$c/work/hello.txt"
  args=(--out "$tmp/$c/requests" --port "$port")
  ((tools)) && args+=(--tool-file "$tmp/$c/work/hello.txt")
  node "$src/tests/tools/capture_server.mjs" "${args[@]}" >"$tmp/$c.server.log" 2>&1 &
  server=$!
  for _ in $(seq 50); do grep -q listening "$tmp/$c.server.log" 2>/dev/null && break; sleep 0.1; done
  grep -q listening "$tmp/$c.server.log" || { cat "$tmp/$c.server.log" >&2; exit 1; }
  rc=0
  agent_run "$c" "http://127.0.0.1:$port" sk-ds4-capture "$tmp/$c" 180 || rc=$?
  kill "$server"; wait "$server" 2>/dev/null || true
  server=
  n=$(find "$tmp/$c/requests" -name '*.json' 2>/dev/null | wc -l)
  if ((rc != 0 || n == 0)); then
    echo "capture.sh: $c exited $rc after $n request(s); its output:" >&2
    cat "$tmp/$c/out.txt" "$tmp/$c/err.txt" >&2
    status=1
    continue
  fi
  name=$c
  ((tools)) && name=$c-tools
  rm -f "$out_dir/$name"-[0-9]*.json
  i=0
  for f in "$tmp/$c/requests"/*.json; do
    i=$((i + 1))
    cp "$f" "$out_dir/$name-$i.json"
  done
  echo "$name: $n request(s), reply: $(tr '\n' ' ' <"$tmp/$c/out.txt" | cut -c1-80)"
done
exit $status
