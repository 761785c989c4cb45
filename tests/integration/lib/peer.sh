# The peer: the CPU build of current llama.cpp that ds4 is checked and
# measured against (../shared/peers/llama.cpp/, see its README), for
# integration tests and benchmarks. Source this file; it sets
#   peer_bin   the folder holding llama-server, llama-quantize, llama-tokenize, llama-bench
# and defines
#   peer_require             exit 77 (skip, saying why) when the peer is not there
#   peer_server_start PORT MODEL [ARGS...]   starts llama-server on 127.0.0.1:PORT, waits
#                            until it answers /health (at most 120 s), sets peer_server_pid
#   peer_server_stop         stops it
# DS4_PEER overrides the folder.
peer_bin=${DS4_PEER:-${DS4_SRC:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)}/../shared/peers/llama.cpp/bin}
peer_server_pid=

peer_require() {
  local tool
  for tool in llama-server llama-quantize llama-tokenize; do
    if [[ ! -x $peer_bin/$tool ]]; then
      echo "SKIP: llama.cpp's $tool is not at $peer_bin (the peer, ../shared/peers/llama.cpp; set DS4_PEER)" >&2
      exit 77
    fi
  done
}

peer_server_start() {
  local port=$1 model=$2
  shift 2
  "$peer_bin/llama-server" -m "$model" --host 127.0.0.1 --port "$port" -np 1 -t 2 --no-webui "$@" \
    >"${TMPDIR:-/tmp}/peer-server-$port.log" 2>&1 &
  peer_server_pid=$!
  local i
  for ((i = 0; i < 1200; i++)); do
    if curl -fs "http://127.0.0.1:$port/health" >/dev/null 2>&1; then return 0; fi
    if ! kill -0 "$peer_server_pid" 2>/dev/null; then
      echo "llama-server exited at start:" >&2
      tail -20 "${TMPDIR:-/tmp}/peer-server-$port.log" >&2
      return 1
    fi
    sleep 0.1
  done
  echo "llama-server did not answer /health within 120 s" >&2
  return 1
}

peer_server_stop() {
  if [[ -n $peer_server_pid ]]; then
    kill "$peer_server_pid" 2>/dev/null || true
    wait "$peer_server_pid" 2>/dev/null || true
    peer_server_pid=
  fi
}
