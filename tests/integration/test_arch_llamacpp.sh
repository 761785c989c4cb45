#!/usr/bin/env bash
# Each architecture ds4 runs, against llama.cpp itself: ds4-mkmodel writes a
# small model of it (F16 and Q8_0), llama.cpp's llama-server loads it, and
# `ds4-worker run --temp 0` must give the same prompt tokens and the same
# greedy tokens on a set of prompts, parting only where llama.cpp's own two
# best candidates are a near tie (tests/integration/arch_compare.py says
# which threshold and why).
#
#   llama3   GQA (4 heads, 2 KV heads), rope_freqs.weight frequency factors,
#            linear rope.scaling keys (RoPE base 10000 and a head of 32, so the
#            factors change the answers within 32 tokens)
#   mistral  a Mistral-shaped llama file (RoPE base 1e6, 8/2 heads)
#   qwen2    QKV bias, NEOX RoPE
#   qwen3    Q/K RMSNorm per head, head size 48 != dim / heads = 32, NEOX RoPE
#   tied     no output.weight: the logits use token_embd
#   qwen3moe qwen3's attention, 8 experts of which each token takes 2, their
#            weights renormalised (the router's near ties: arch_compare.py)
#   qwen2moe qwen2's attention, 8 experts (2 a token) and a shared expert
#            under its sigmoid gate
#
# Vocabulary: stories260K's (SentencePiece); its byte tokens never win
# (--no-byte-tokens), since llama-server refuses text that is not UTF-8.
# Environment: DS4_BIN, DS4_MODELS, DS4_SRC; ports 19250-19259.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=${DS4_SRC:-$(cd "$here/../.." && pwd)}
bin=${DS4_BIN:?DS4_BIN must name the folder holding ds4-mkmodel and ds4-worker}
models=${DS4_MODELS:?DS4_MODELS must name the folder holding stories260K.gguf}
vocab=$models/stories260K.gguf
source "$here/lib/peer.sh"
peer_require
command -v python3 >/dev/null || { echo "SKIP: python3 is not installed (arch_compare.py)" >&2; exit 77; }
[[ -r $vocab ]] || { echo "FAIL: $vocab is missing" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'peer_server_stop; rm -rf "$tmp"' EXIT
port=19250

# The generator refuses what it cannot write, naming the option.
expect_error() {  # expect_error PATTERN ARGS...
  local pattern=$1 out rc=0
  shift
  out=$("$bin/ds4-mkmodel" --out "$tmp/bad.gguf" --vocab-from "$vocab" --dim 64 --layers 1 --ff 128 --heads 4 "$@" 2>&1) || rc=$?
  [[ $rc -ne 0 && $out == *"$pattern"* ]] || { echo "FAIL: ds4-mkmodel $*: exit $rc, '$out' lacks '$pattern'" >&2; exit 1; }
  echo "ok: ds4-mkmodel $*: $out"
}
expect_error "unknown architecture 'gpt2' (expected llama, mistral, qwen2, qwen3, qwen2moe, qwen3moe)" --arch gpt2
expect_error "--experts: qwen3moe needs at least 2 experts per layer" --arch qwen3moe --expert-ff 64
expect_error "--experts-used must be between 1 and --experts (4)" --arch qwen3moe --experts 4 --experts-used 5 --expert-ff 64
expect_error "qwen2 is a dense model" --arch qwen2 --experts 4
expect_error "--shared-ff: qwen3moe has no shared expert" --arch qwen3moe --experts 4 --experts-used 2 --expert-ff 64 --shared-ff 64
expect_error "--rope-freqs: qwen2 files have no rope_freqs.weight" --arch qwen2 --rope-freqs
expect_error "head size 7 must be even" --arch qwen3 --head-dim 7

common=(--dim 128 --layers 3 --ff 320 --no-byte-tokens --ctx 512 --seed 11)
declare -A arch_args=(
  [llama3]="--arch llama --heads 4 --kv-heads 2 --rope-freqs --rope-scale 2"
  [mistral]="--arch mistral --heads 8 --kv-heads 2"
  [qwen2]="--arch qwen2 --heads 4 --kv-heads 2"
  [qwen3]="--arch qwen3 --heads 4 --kv-heads 2 --head-dim 48"
  [tied]="--arch llama --heads 4 --kv-heads 4 --tied"
  [qwen3moe]="--arch qwen3moe --heads 4 --kv-heads 2 --head-dim 48 --experts 8 --experts-used 2 --expert-ff 96"
  [qwen2moe]="--arch qwen2moe --heads 4 --kv-heads 2 --experts 8 --experts-used 2 --expert-ff 96 --shared-ff 192"
)
prompts=("Once upon a time" "The little dog ran" "Lily and Tom" "One day, a girl named Sue" "He said")

failed=0
for name in llama3 mistral qwen2 qwen3 tied qwen3moe qwen2moe; do
  for type in f16 q8_0; do
    model=$tmp/$name-$type.gguf
    # shellcheck disable=SC2086
    "$bin/ds4-mkmodel" --out "$model" --vocab-from "$vocab" "${common[@]}" ${arch_args[$name]} --type "$type" \
      2>"$tmp/mk.log" || { cat "$tmp/mk.log" >&2; echo "FAIL: ds4-mkmodel for $name $type" >&2; exit 1; }
    # One thread: the machine is shared, and llama.cpp's spinning threads slow to a crawl when it is busy.
    peer_server_start "$port" "$model" --no-jinja -t 1 -c 512 ||
      { echo "FAIL: llama.cpp does not load the $name $type model" >&2; exit 1; }
    echo "--- $name $type"
    near_tie=0.1
    [[ $type == q8_0 ]] && near_tie=0.25
    # The router's near tie (mixtures of experts): test_moe_llamacpp.sh says why.
    router_tie=
    [[ $name == *moe ]] && router_tie=$([[ $type == q8_0 ]] && echo 0.15 || echo 0.01)
    if ! DS4_ROUTER_TIE=$router_tie python3 "$here/arch_compare.py" "$bin/ds4-worker" "$model" "$port" 32 "$near_tie" "${prompts[@]}"; then
      failed=1
    fi
    peer_server_stop
  done
done

# A q8_0 KV cache (--kv-cache q8_0) against llama.cpp's (-ctk q8_0 -ctv q8_0,
# which needs its flash attention): both round each cached row per 32 values
# to 8 bits as ggml's q8_0 does; llama.cpp also rounds the query to 8 bits,
# ds4 keeps it f32, so the answers may part at a q8_0-sized near tie.
for name in llama3 qwen2; do
  model=$tmp/$name-f16.gguf
  # shellcheck disable=SC2086
  "$bin/ds4-mkmodel" --out "$model" --vocab-from "$vocab" "${common[@]}" ${arch_args[$name]} --type f16 \
    2>"$tmp/mk.log" || { cat "$tmp/mk.log" >&2; echo "FAIL: ds4-mkmodel for $name f16" >&2; exit 1; }
  peer_server_start "$port" "$model" --no-jinja -t 1 -c 512 -fa on -ctk q8_0 -ctv q8_0 ||
    { echo "FAIL: llama.cpp does not load the $name model with a q8_0 cache" >&2; exit 1; }
  echo "--- $name f16, q8_0 KV cache"
  DS4_WORKER_ARGS="--kv-cache q8_0" python3 "$here/arch_compare.py" "$bin/ds4-worker" "$model" "$port" 32 0.25 \
    "${prompts[@]}" || failed=1
  peer_server_stop
done
# A head size that is not a multiple of 32 cannot be kept in q8_0: said before anything runs.
out=$("$bin/ds4-worker" run --model "$tmp/qwen3-f16.gguf" -p "Once" -n 1 --kv-cache q8_0 2>&1) && rc=0 || rc=$?
[[ $rc -ne 0 && $out == *"a q8_0 KV cache needs a head size that is a multiple of 32; this model's is 48"* ]] ||
  { echo "FAIL: --kv-cache q8_0 on a head of 48: exit $rc, '$out'" >&2; failed=1; }

[[ $failed == 0 ]] || { echo "FAIL: ds4 and llama.cpp disagree (above)" >&2; exit 1; }
echo "PASS"
