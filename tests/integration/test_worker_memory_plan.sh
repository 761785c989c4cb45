#!/usr/bin/env bash
# The memory plan against the truth: a serving worker's anonymous memory
# (RssAnon: everything but the shared weights, which are the file's or the
# segment's pages) must be within 10% or 8 MiB of what it says it needs (its
# plan: KV cache + scratch, the figure every fit decision rests on). On
# stories260K and on a synthetic 1 GB model (TinyLlama-shaped, Q8_0), after
# a request has run. A CUDA build's CPU worker is held to the same figure: it
# must not pay for GPU libraries it does not use (cuBLAS cost ~94 MB a
# process while it was linked).
# Exit 0 = pass, 1 = fail, 77 = skipped (reason printed).
set -u
bin=${DS4_BIN:?DS4_BIN must name the bin folder of a build}
models=${DS4_MODELS:?DS4_MODELS must name the folder holding stories260K.gguf}
[[ -x $bin/ds4-worker && -x $bin/ds4-mkmodel ]] || { echo "SKIP: no ds4-worker/ds4-mkmodel in $bin"; exit 77; }
command -v python3 >/dev/null || { echo "SKIP: python3 is needed to talk to the worker"; exit 77; }
T=$(mktemp -d /tmp/ds4-plan-test.XXXXXX)
pid=
segs=()  # the segments of this test's own model: nothing else will use them (1 GB of /dev/shm)
trap '[[ -n $pid ]] && kill -9 $pid 2>/dev/null; for s in "${segs[@]}"; do rm -f "/dev/shm/$s"; done; rm -rf "$T"' EXIT
fails=0

"$bin/ds4-mkmodel" --out "$T/1b.gguf" --vocab-from "$models/stories260K.gguf" --preset 1b --type q8_0 >/dev/null 2>&1 ||
  { echo "SKIP: ds4-mkmodel could not write a 1 GB model in $T (disk space?)"; exit 77; }

measure() {  # measure NAME MODEL CONTEXT SLOTS
  local name=$1 model=$2 ctx=$3 slots=$4 sock=$T/w.sock
  rm -f "$sock"
  "$bin/ds4-worker" serve --model "$model" --socket "$sock" --id 0 --context "$ctx" --slots "$slots" --threads 2 \
    --device cpu >"$T/w.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do grep -q serving "$T/w.log" && break; sleep 0.1; done
  grep -q serving "$T/w.log" || { echo "FAIL - $name: the worker did not start"; cat "$T/w.log"; fails=$((fails + 1)); return; }
  # One request, so that every scratch buffer has been used.
  python3 - "$sock" <<'PY' || { echo "FAIL - $name: the request failed"; fails=$((fails + 1)); }
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall((json.dumps({"op": "generate", "id": 1, "prompt": [1, 403, 407, 261], "max_tokens": 16,
                       "temperature": 0}) + "\n").encode())
buf = b""
while b'"ev":"done"' not in buf and b'"ev":"error"' not in buf:
    d = s.recv(65536)
    if not d:
        break
    buf += d
assert b'"ev":"done"' in buf, buf[-300:]
PY
  local kv scratch plan anon
  kv=$(sed -n 's/.*DS4_KV_BYTES=\([0-9]*\).*/\1/p' "$T/w.log" | head -1)
  scratch=$(sed -n 's/.*DS4_SCRATCH_BYTES=\([0-9]*\).*/\1/p' "$T/w.log" | head -1)
  plan=$((kv + scratch))
  anon=$(($(awk '/^RssAnon:/ {print $2}' "/proc/$pid/status") * 1024))
  kill $pid
  wait $pid 2>/dev/null
  pid=
  if [[ $model == "$T"/* ]]; then
    local seg
    seg=$(sed -n 's/.*attached model segment \(ds4-model-[0-9a-f]*\) .*/\1/p' "$T/w.log" | head -1)
    [[ -n $seg ]] && segs+=("$seg")
  fi
  local diff=$((anon > plan ? anon - plan : plan - anon)) bound=$((plan / 10 > 8 << 20 ? plan / 10 : 8 << 20))
  local line="$name: plan $((plan >> 10)) KiB, RssAnon $((anon >> 10)) KiB, off by $((diff >> 10)) KiB (bound $((bound >> 10)) KiB)"
  if ((diff <= bound)); then echo "ok   - $line"; else echo "FAIL - $line"; fails=$((fails + 1)); fi
}

measure "stories260K, context 256 x 2 slots" "$models/stories260K.gguf" 256 2
measure "1 GB Q8_0, context 2048 x 4 slots" "$T/1b.gguf" 2048 4
measure "1 GB Q8_0, context 512 x 1 slot" "$T/1b.gguf" 512 1
((fails == 0)) && echo PASS || exit 1
