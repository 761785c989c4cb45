#!/usr/bin/env bash
# The CUDA backend on a GPU machine in one go: build, conformance tests,
# CPU-vs-CUDA greedy tokens on stories260K, and llama-bench style speed on
# synthetic 1B (f16, q8_0) and 7B (f16) models. Logs go to $OUT (or ./out).
#   bench/cuda.sh [all|test|bench]   (stories260K is read from .devdata/ or ../shared/models/)
# Environment: DEVDATA (default .devdata) is the folder of carried binaries;
# VARIANTS, a ';'-separated list of environment settings (e.g.
# "DS4_CUDA_GEMV=0;DS4_CUDA_GEMV=2"), times the GEMV and benches each model
# again under each of them (VARIANT_REPS repetitions, default 3); GEMV_VARIANTS,
# if set, replaces VARIANTS for the GEMV timing; CPU_TESTS=0 leaves out the
# CPU kernel tests.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
what=${1:-all}
dev=${DEVDATA:-.devdata}
IFS=';' read -r -a variants <<<"${VARIANTS:-}"
IFS=';' read -r -a gemv_variants <<<"${GEMV_VARIANTS:-${VARIANTS:-}}"
jobs=$(nproc)
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }

models=../shared/models
if [ ! -f $models/stories260K.gguf ]; then
  mkdir -p $models && cp $dev/stories260K.gguf $models/
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/summary.txt"

if [ -x $dev/bin/ds4-worker ]; then
  # Binaries built elsewhere (a GPU machine without the project's libraries):
  # their shared libraries beside them, the model where the tests were told to look.
  bin=$dev/bin
  export LD_LIBRARY_PATH=$PWD/$dev/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
  tests=$bin/ds4_unit_tests; [ -x $tests ] || tests=$bin/ds4_cuda_tests
  built_models=/work/shared/models  # DS4_SHARED_MODELS of the build that made them
  mkdir -p /work/main "$built_models" && cp $dev/stories260K.gguf "$built_models/"
  log "prebuilt binaries (models for tests at $built_models)"
else
  log build
  t0=$(date +%s)
  cmake -S . -B build-gpu -G Ninja -DDS4_CUDA=ON -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
    cmake --build build-gpu -j"$jobs" --target ds4-worker ds4-mkmodel ds4_unit_tests >>"$OUT/build.log" 2>&1
  rc=$?
  log "build rc=$rc in $(( $(date +%s) - t0 )) s"
  if [ $rc != 0 ]; then grep -E "error|Error" -A3 "$OUT/build.log" | head -60; exit 1; fi
  bin=build-gpu/bin
  tests=$bin/ds4_unit_tests
fi

if [ "$what" != bench ]; then
  log "unit tests: cuda"
  timeout 300 $tests -tc='cuda:*' >"$OUT/test_cuda.log" 2>&1
  log "cuda tests rc=$?"; tail -5 "$OUT/test_cuda.log" | tee -a "$OUT/summary.txt"
  grep -E "ERROR|FAILED|CHECK|with expansion|values:|  CHECK" "$OUT/test_cuda.log" | head -40
  if [ "${CPU_TESTS:-1}" != 0 ]; then
    log "unit tests: cpu kernels and engine ($(grep -o 'avx512[a-z]*' /proc/cpuinfo | sort -u | tr '\n' ' '))"
    timeout 300 $tests -tc='kernels*,engine*' >"$OUT/test_cpu.log" 2>&1
    log "cpu tests rc=$?"; tail -4 "$OUT/test_cpu.log" | tee -a "$OUT/summary.txt"
    grep -E "ERROR|FAILED" -A6 "$OUT/test_cpu.log" | head -40
  fi
  log "decode GEMV bandwidth (weight bytes read / time, graph of 64 launches)"
  timeout 300 $tests --no-skip -tc='cuda: decode GEMV*' 2>&1 | grep '^gemv' | tee -a "$OUT/summary.txt"
  for v in "${gemv_variants[@]}"; do
    log "decode GEMV bandwidth with $v (and the product tests)"
    env $v timeout 120 $tests -tc='cuda: matrix*,cuda: the fused*,cuda: RMSNorm*' 2>&1 | tail -2 | tee -a "$OUT/summary.txt"
    env $v timeout 300 $tests --no-skip -tc='cuda: decode GEMV*' 2>&1 | grep '^gemv' | tee -a "$OUT/summary.txt"
  done
  log "greedy tokens, cpu vs cuda (stories260K)"
  for p in "Once upon a time" "The little cat"; do
    $bin/ds4-worker run --model $models/stories260K.gguf -p "$p" -n 200 --temp 0 --ignore-eos --json --device cpu >"$OUT/cpu.json" 2>/dev/null
    $bin/ds4-worker run --model $models/stories260K.gguf -p "$p" -n 200 --temp 0 --ignore-eos --json --device cuda >"$OUT/gpu.json" 2>"$OUT/gpu_run.err"
    if cmp -s "$OUT/cpu.json" "$OUT/gpu.json"; then log "'$p': identical 200 tokens"; else log "'$p': DIFFERENT"; head -c 600 "$OUT/cpu.json" "$OUT/gpu.json" "$OUT/gpu_run.err"; fi
  done
fi

if [ "$what" != test ]; then
  mk() { [ -f "$2" ] || $bin/ds4-mkmodel --out "$2" --vocab-from $models/stories260K.gguf $1 >/dev/null 2>>"$OUT/mkmodel.log"; }
  dir=/tmp/ds4models; mkdir -p $dir
  t0=$(date +%s)
  mk "--preset 1b --type f16" $dir/1b-f16.gguf
  mk "--preset 1b --type q8_0" $dir/1b-q8.gguf
  mk "--preset 7b --ff 14336 --kv-heads 8 --type f16" $dir/7b-f16.gguf
  log "models made in $(( $(date +%s) - t0 )) s"; ls -la $dir | tee -a "$OUT/summary.txt"
  df -h /dev/shm | tee -a "$OUT/summary.txt"
  avail=$(df --output=avail -B1G /dev/shm | tail -1)
  if [ "$avail" -lt 40 ]; then mount -o remount,size=80G /dev/shm || true; fi
  for m in 1b-f16 1b-q8 7b-f16; do
    log "bench $m"
    timeout 240 $bin/ds4-worker bench --model $dir/$m.gguf -p 512 -n 128 -r 3 --device cuda 2>>"$OUT/bench.err" | tee -a "$OUT/summary.txt"
    for v in "${variants[@]}"; do
      log "bench $m with $v"
      env $v timeout 240 $bin/ds4-worker bench --model $dir/$m.gguf -p 512 -n 128 -r ${VARIANT_REPS:-3} --device cuda 2>>"$OUT/bench.err" | tee -a "$OUT/summary.txt"
    done
    # An earlier build carried in $dev/bin-old: before/after on the same machine.
    if [ -x $dev/bin-old/ds4-worker ]; then
      log "bench $m (previous build)"
      timeout 240 $dev/bin-old/ds4-worker bench --model $dir/$m.gguf -p 512 -n 128 -r 3 --device cuda 2>>"$OUT/bench.err" | tee -a "$OUT/summary.txt"
    fi
    $bin/ds4-worker unload --model $dir/$m.gguf >/dev/null 2>&1
  done
fi
