#!/usr/bin/env bash
# GPU weights that outlive the worker, on a GPU machine in one go:
#   1. the CUDA unit tests (holder, host-mapped and device sampling included);
#   2. greedy tokens on stories260K: CPU vs CUDA with copied, holder-mapped
#      and host-mapped weights (ds4-worker run --json);
#   3. the 7B synthetic model: a holder, then two workers that map its weights
#      (device memory after each), a worker that copies them, a host-mapped one;
#   4. restart: SIGKILL a `serve` worker and time kill -> answering again, with
#      the holder and with a fresh copy (bench/cuda_restart.py).
# Binaries and their libraries come from $D4 (default .devdata-d1: bin/, lib/,
# stories260K.gguf), built elsewhere. Logs and figures go to $OUT (or ./out).
#   bench/cuda_holder.sh [all|test|seven]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
D4=${D4:-.devdata-d1}
mkdir -p "$OUT"
what=${1:-all}
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }'; }
mem() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }

bin=$D4/bin
export LD_LIBRARY_PATH=$PWD/$D4/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp/ds4-xdg}
mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"
stories=/work/shared/models/stories260K.gguf  # DS4_SHARED_MODELS of the build
mkdir -p /work/shared/models && cp -n $D4/stories260K.gguf $stories 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee -a "$OUT/summary.txt"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT

# Waits (at most $2 s) until socket $1 exists.
wait_socket() { for _ in $(seq 1 $(( $2 * 20 ))); do [ -S "$1" ] && return 0; sleep 0.05; done; return 1; }

if [ "$what" != seven ]; then
  if [ -x $bin/ds4_unit_tests ]; then
    log "unit tests: cuda"
    timeout 300 $bin/ds4_unit_tests -tc='cuda:*' >"$OUT/test_cuda.log" 2>&1
    log "cuda tests rc=$?"; tail -4 "$OUT/test_cuda.log" | tee -a "$OUT/summary.txt"
    grep -E "ERROR|FAILED|skipped" -A4 "$OUT/test_cuda.log" | head -40
  fi

  log "greedy tokens on stories260K: cpu vs cuda (copy, holder, host-mapped)"
  hs=$XDG_RUNTIME_DIR/holder-stories.sock
  $bin/ds4-worker hold --model $stories --device cuda:0 --socket $hs >"$OUT/hold_stories.log" 2>&1 &
  pids+=($!)
  wait_socket $hs 60 || { log "stories holder did not start"; cat "$OUT/hold_stories.log"; }
  for p in "Once upon a time" "The little cat"; do
    $bin/ds4-worker run --model $stories -p "$p" -n 200 --temp 0 --ignore-eos --json --device cpu >"$OUT/cpu.json" 2>/dev/null
    for mode in copy holder host-mapped; do
      $bin/ds4-worker run --model $stories -p "$p" -n 200 --temp 0 --ignore-eos --json --device cuda \
        --gpu-weights $mode --holder-socket $hs >"$OUT/gpu.json" 2>"$OUT/gpu_$mode.err"
      if cmp -s "$OUT/cpu.json" "$OUT/gpu.json"; then r=identical; else r=DIFFERENT; fi
      log "'$p' $mode: $r 200 tokens; $(grep -ohE 'weights (mapped|from)[^;]*|no weights[^;]*' "$OUT/gpu_$mode.err" | head -1)"
    done
  done
  kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; pids=()
fi

if [ "$what" != test ]; then
  avail=$(df --output=avail -B1G /dev/shm | tail -1)
  if [ "$avail" -lt 40 ]; then mount -o remount,size=80G /dev/shm || true; fi
  m=/tmp/ds4models/7b-f16.gguf; mkdir -p /tmp/ds4models
  t0=$(date +%s.%N)
  [ -f $m ] || timeout 240 $bin/ds4-mkmodel --out $m --vocab-from $stories --preset 7b --ff 14336 --kv-heads 8 --type f16 >/dev/null 2>"$OUT/mkmodel.log"
  seg=$(timeout 240 $bin/ds4-worker load --model $m 2>/dev/null | tail -1)
  log "7B model made and loaded into $seg in $(since $t0) s"
  base=$(mem); log "device memory used before: $base MiB"

  hs=$XDG_RUNTIME_DIR/holder-cuda0.sock
  t0=$(date +%s.%N)
  $bin/ds4-worker hold --segment $seg --device cuda:0 --socket $hs >"$OUT/hold_7b.log" 2>&1 &
  hold_pid=$!; pids+=($hold_pid)
  wait_socket $hs 120 || { log "7B holder did not start"; cat "$OUT/hold_7b.log"; }
  log "holder ready in $(since $t0) s: $(grep -o 'holding.*' "$OUT/hold_7b.log" | head -1)"
  sleep 1; after_holder=$(mem); log "device memory used with the holder: $after_holder MiB (+$((after_holder - base)))"

  serve() {  # serve SOCKET MODE [extra args]
    local s=$1 mode=$2; shift 2
    $bin/ds4-worker serve --segment $seg --socket $s --context 4096 --slots 1 --batch 256 --device cuda:0 \
      --gpu-weights $mode --holder-socket $hs "$@" >>"$OUT/serve_$mode.log" 2>&1 &
    pids+=($!)
    wait_socket $s 120 || log "worker on $s did not start"
  }
  serve /tmp/w1.sock holder; sleep 1; m1=$(mem)
  log "worker 1 (holder) up: $m1 MiB (+$((m1 - after_holder)))"
  serve /tmp/w2.sock holder; sleep 1; m2=$(mem)
  log "worker 2 (holder) up: $m2 MiB (+$((m2 - m1)))"
  grep -h "memory reserved" "$OUT/serve_holder.log" | head -1 | tee -a "$OUT/summary.txt"
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee -a "$OUT/summary.txt"
  for p in "${pids[@]:1}"; do kill $p; done; sleep 2
  m0=$(mem)
  serve /tmp/w3.sock copy; sleep 1; m3=$(mem)
  log "worker 3 (copy) up: $m3 MiB (+$((m3 - m0)) over $m0 with the holder only)"
  kill ${pids[-1]}; sleep 2; m0=$(mem)
  serve /tmp/w4.sock host-mapped; sleep 1; m4=$(mem)
  log "worker 4 (host-mapped) up: $m4 MiB (+$((m4 - m0)))"
  python3 - <<'EOF' 2>&1 | tee -a "$OUT/summary.txt"
import json, socket, time
t0 = time.monotonic()
s = socket.socket(socket.AF_UNIX); s.settimeout(120); s.connect("/tmp/w4.sock")
s.sendall(b'{"op":"generate","prompt":[1,2,3,4],"max_tokens":4,"temperature":0}\n')
buf = b""
while not (buf.endswith(b"\n") and (b'"done"' in buf or b'"error"' in buf)):
    c = s.recv(65536)
    if not c: break
    buf += c
print("host-mapped 7B: 4 tokens in %.2f s:" % (time.monotonic() - t0), [json.loads(l).get("t") for l in buf.split(b"\n") if l.strip()])
EOF
  kill ${pids[-1]}; sleep 2

  log "restart of a SIGKILLed worker (7B): with the holder"
  timeout 200 python3 bench/cuda_restart.py --label holder --socket /tmp/r.sock --reps 3 --log "$OUT/restart_holder.log" -- \
    $bin/ds4-worker serve --segment $seg --socket /tmp/r.sock --context 4096 --slots 1 --device cuda:0 \
    --gpu-weights holder --holder-socket $hs | tee -a "$OUT/summary.txt"
  log "restart of a SIGKILLed worker (7B): copying the weights (fresh start)"
  timeout 200 python3 bench/cuda_restart.py --label copy --socket /tmp/r.sock --reps 3 --log "$OUT/restart_copy.log" -- \
    $bin/ds4-worker serve --segment $seg --socket /tmp/r.sock --context 4096 --slots 1 --device cuda:0 \
    --gpu-weights copy | tee -a "$OUT/summary.txt"
  log "holder killed (SIGKILL): the next worker falls back to a copy"
  kill -9 $hold_pid; sleep 1
  timeout 120 python3 bench/cuda_restart.py --label after-holder-death --socket /tmp/r.sock --reps 1 --log "$OUT/restart_fallback.log" -- \
    $bin/ds4-worker serve --segment $seg --socket /tmp/r.sock --context 4096 --slots 1 --device cuda:0 \
    --gpu-weights holder --holder-socket $hs | tee -a "$OUT/summary.txt"
  grep -h "no weights from the holder" "$OUT/restart_fallback.log" | head -1 | tee -a "$OUT/summary.txt"
  $bin/ds4-worker unload --segment $seg >/dev/null 2>&1
fi
