#!/usr/bin/env bash
# Every architecture and weight type on the CUDA backend, against llama.cpp:
# the GPU machine has no llama.cpp build, so the reference answers are
# recorded here and checked there.
#
#   cuda_arch.sh refs DIR    (this machine: the peer, ds4-mkmodel) writes into DIR
#                            the models (F16 and Q8_0 from ds4-mkmodel, K-quants
#                            and Q4_0 from llama-quantize) and llama-server's
#                            greedy answers for each (DIR/<model>.json); checks
#                            the CPU backend against them on the way
#   cuda_arch.sh check DIR   (the GPU machine) runs `ds4-worker run --device cuda:0`
#                            on each model of DIR against its recorded answers,
#                            with the near-tie rule of arch_compare.py
#
# F16 and Q8_0 files are not carried: `check` writes them again with the same
# ds4-mkmodel arguments and refuses a file whose sha256 differs from the one
# recorded. Environment: DS4_BIN (ds4-mkmodel, ds4-worker), DS4_MODELS
# (stories260K.gguf), DS4_SRC, DS4_PEER (refs only: the peer's bin folder,
# default ../shared/peers/llama.cpp/bin). Port 19260.
# CUDA_ARCH_ARCHS="qwen3moe qwen2moe" takes only those architectures (refs and
# check alike). CUDA_ARCH_HOST_EXPERTS="0 1" checks each mixture of experts
# once per expert rung (`--host-experts`: the first N layers' experts on the
# host), each against the same llama.cpp answers.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=${DS4_SRC:-$(cd "$here/../.." && pwd)}
bin=${DS4_BIN:?DS4_BIN must name the folder holding ds4-mkmodel and ds4-worker}
models=${DS4_MODELS:?DS4_MODELS must name the folder holding stories260K.gguf}
mode=${1:?usage: cuda_arch.sh refs|check DIR}
dir=${2:?usage: cuda_arch.sh refs|check DIR}
compare=$src/tests/integration/arch_compare.py
n_predict=32
prompts=("Once upon a time" "The little dog ran" "Lily and Tom" "One day, a girl named Sue")

# Rows of multiples of 256 so that every matrix takes the K-quants; head
# sizes the CUDA attention takes (qwen3: 64, not dim / heads = 32).
common=(--vocab-from "$models/stories260K.gguf" --dim 256 --layers 2 --ff 512 --no-byte-tokens --ctx 512 --seed 11)
declare -A arch_args=(
  [llama3]="--arch llama --heads 4 --kv-heads 2 --rope-freqs --rope-scale 2"
  [mistral]="--arch mistral --heads 4 --kv-heads 1"
  [qwen2]="--arch qwen2 --heads 4 --kv-heads 2"
  [qwen3]="--arch qwen3 --heads 8 --kv-heads 4 --head-dim 64"
  [tied]="--arch llama --heads 4 --kv-heads 4 --tied"
  [qwen3moe]="--arch qwen3moe --heads 8 --kv-heads 4 --head-dim 64 --experts 8 --experts-used 2 --expert-ff 256"
  [qwen2moe]="--arch qwen2moe --heads 4 --kv-heads 2 --experts 8 --experts-used 2 --expert-ff 256 --shared-ff 512"
)
read -r -a archs <<<"${CUDA_ARCH_ARCHS:-llama3 mistral qwen2 qwen3 tied qwen3moe qwen2moe}"
read -r -a host_experts <<<"${CUDA_ARCH_HOST_EXPERTS:-0}"
quants=(Q4_K_M Q5_K_M Q6_K Q4_0 Q2_K)  # from the F16 file, for llama3 and qwen3
# The near-tie thresholds of arch_compare.py (F16, Q8_0) and quants_greedy.sh
# (the other types, 0.15: llama.cpp's CPU code against itself). On the GPU the
# other types take 0.25, Q8_0's: the dp4a products round activations to 8 bits
# per block of 32 (as llama.cpp's CUDA code does), where llama.cpp's CPU code
# rounds them per block of 256 (Q8_K) for the K-quants: two grids, as with
# Q8_0's CPU/GPU pair.
# Q2_K on the CPU takes 0.2: on qwen3-q2_k, llama.cpp's flash attention on
# against off (its CPU attention sums V in f16 with it on) moves the best
# two's margin by up to 0.196 nats, and ds4 took the second at 0.170.
near_tie() {  # near_tie TYPE MODE
  case $1 in f16) echo 0.1 ;; q8_0) echo 0.25 ;; q2_k) [[ $2 == check ]] && echo 0.25 || echo 0.2 ;;
             *) [[ $2 == check ]] && echo 0.25 || echo 0.15 ;; esac
}

# The share of tokens that must agree before a near tie (arch_compare.py's
# DS4_MIN_AGREED; half by default). These files are two layers of random
# weights, and the quantized qwen3 ones have llama.cpp's own best two within
# 0.15 nats at 13-19% of its tokens (9-12% for the others): llama.cpp against
# itself, flash attention on and off, parts after 3 to 28 tokens on them and
# moves a margin by up to 0.2 nats (0.5 on qwen3moe Q4_K_M, a router flip).
# There a quarter must agree; every parting must still be at a near tie.
min_agreed() {  # min_agreed MODEL
  case $1 in qwen3*-f16 | qwen3*-q8_0) echo "" ;; qwen3*) echo 0.25 ;; *) echo "" ;; esac
}

# Mixtures of experts: the router's near tie of arch_compare.py
# (test_moe_llamacpp.sh says why), a little wider for F16 on the GPU, whose
# prefill products take f16 activations.
router_tie() {  # router_tie MODEL MODE
  case $1 in *moe-f16) [[ $2 == check ]] && echo 0.02 || echo 0.01 ;; *moe-*) echo 0.15 ;; *) echo "" ;; esac
}

mk() {  # mk ARCH TYPE OUT
  # shellcheck disable=SC2086
  "$bin/ds4-mkmodel" --out "$3" "${common[@]}" ${arch_args[$1]} --type "$2" >/dev/null 2>&1 ||
    { echo "FAIL: ds4-mkmodel $1 $2" >&2; exit 1; }
}

case $mode in
  refs)
    source "$src/tests/integration/lib/peer.sh"
    peer_require
    mkdir -p "$dir"
    trap peer_server_stop EXIT
    for a in "${archs[@]}"; do
      for t in f16 q8_0; do
        mk "$a" "$t" "$dir/$a-$t.gguf"
        sha256sum "$dir/$a-$t.gguf" | cut -d' ' -f1 >"$dir/$a-$t.sha256"
      done
      qs=()
      [[ $a == llama3 || $a == qwen3 ]] && qs=("${quants[@]}")
      [[ $a == *moe ]] && qs=(Q4_K_M Q6_K)
      if [[ ${#qs[@]} -gt 0 ]]; then
        for q in "${qs[@]}"; do
          "$peer_bin/llama-quantize" "$dir/$a-f16.gguf" "$dir/$a-${q,,}.gguf" "$q" >"$dir/quantize.log" 2>&1 ||
            { tail -5 "$dir/quantize.log" >&2; echo "FAIL: llama-quantize $a $q" >&2; exit 1; }
        done
      fi
    done
    rm -f "$dir/quantize.log"
    failed=0
    for m in "$dir"/*.gguf; do
      name=$(basename "$m" .gguf)
      peer_server_start 19260 "$m" --no-jinja -t 1 -c 512 || { echo "FAIL: llama.cpp does not load $name" >&2; exit 1; }
      python3 "$compare" --record "$dir/$name.json" 19260 "$n_predict" "${prompts[@]}"
      peer_server_stop
      echo "--- $name (cpu)"
      DS4_DEVICE=cpu DS4_MIN_AGREED=$(min_agreed "$name") DS4_ROUTER_TIE=$(router_tie "$name" "$mode") python3 "$compare" "$bin/ds4-worker" "$m" "$dir/$name.json" "$n_predict" \
        "$(near_tie "${name#*-}" "$mode")" "${prompts[@]}" || failed=1
    done
    # The files ds4-mkmodel writes again where they are checked.
    rm -f "$dir"/*-f16.gguf "$dir"/*-q8_0.gguf
    [[ $failed == 0 ]] || { echo "FAIL: the CPU backend parts from llama.cpp (above)" >&2; exit 1; }
    echo "ok: references in $dir"
    ;;
  check)
    failed=0
    for a in "${archs[@]}"; do
      for t in f16 q8_0; do
        mk "$a" "$t" "$dir/$a-$t.gguf"
        [[ $(sha256sum "$dir/$a-$t.gguf" | cut -d' ' -f1) == $(cat "$dir/$a-$t.sha256") ]] ||
          { echo "FAIL: ds4-mkmodel wrote another $a-$t.gguf here than where the references were taken" >&2; exit 1; }
      done
    done
    for m in "$dir"/*.gguf; do
      name=$(basename "$m" .gguf)
      rungs=(0)
      [[ $name == *moe-* ]] && rungs=("${host_experts[@]}")
      for n in "${rungs[@]}"; do
        echo "--- $name (cuda:0$([[ $n == 0 ]] || echo ", the experts of $n layers on the host"))"
        DS4_HOST_EXPERTS=$n DS4_DEVICE=cuda:0 DS4_MIN_AGREED=$(min_agreed "$name") DS4_ROUTER_TIE=$(router_tie "$name" "$mode") python3 "$compare" "$bin/ds4-worker" "$m" \
          "$dir/$name.json" "$n_predict" "$(near_tie "${name#*-}" "$mode")" "${prompts[@]}" || failed=1
      done
    done
    [[ $failed == 0 ]] || { echo "FAIL: the CUDA backend parts from llama.cpp (above)" >&2; exit 1; }
    echo "ok: every model gives llama.cpp's greedy tokens on cuda:0"
    ;;
  *) echo "usage: cuda_arch.sh refs|check DIR" >&2; exit 2 ;;
esac
