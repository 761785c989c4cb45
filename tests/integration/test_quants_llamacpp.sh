#!/usr/bin/env bash
# ds4 dequantizes every weight type as llama.cpp does, bit for bit, on blocks
# that llama.cpp itself wrote: ds4-mkmodel writes an F16 model, the peer's
# llama-quantize quantizes it (one type for all tensors with --pure, and the
# mixed Q4_K_M / Q5_K_M / Q3_K_M / Q2_K files), then dequantizes that file to
# F32 with ggml's own code; ds4's dequantize_row must give the F32 file's bits
# for every tensor (tests/unit/test_quants.cpp, case DS4_QUANT_PAIRS).
#
# Environment: DS4_BIN (folder with ds4-mkmodel and ds4_unit_tests),
# DS4_MODELS (folder with stories260K.gguf), DS4_SRC (source tree), DS4_PEER
# (the llama.cpp peer's bin folder; default ../shared/peers/llama.cpp/bin).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export DS4_SRC=${DS4_SRC:-$(cd "$here/../.." && pwd)}
bin=${DS4_BIN:?DS4_BIN must name the folder holding ds4-mkmodel and ds4_unit_tests}
models=${DS4_MODELS:?DS4_MODELS must name the folder holding stories260K.gguf}
source "$here/lib/peer.sh"
peer_require

fail() { echo "FAIL: $*" >&2; exit 1; }
[[ -x $bin/ds4-mkmodel ]] || fail "$bin/ds4-mkmodel is missing (build the ds4-mkmodel target)"
[[ -x $bin/ds4_unit_tests ]] || fail "$bin/ds4_unit_tests is missing (build the ds4_unit_tests target)"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
quantize() { "$peer_bin/llama-quantize" "$@" >"$tmp/quantize.log" 2>&1 || { tail -20 "$tmp/quantize.log" >&2; fail "llama-quantize $*"; }; }

# Rows of 256 (the K-quants' block) and a feed-forward of 704 (not a multiple
# of 256: llama-quantize then picks its fallback types for those tensors,
# Q5_0, Q5_1, Q8_0, IQ4_NL).
"$bin/ds4-mkmodel" --out "$tmp/f16.gguf" --vocab-from "$models/stories260K.gguf" --dim 256 --layers 2 \
  --ff 768 --heads 4 --kv-heads 2 --type f16 --seed 5 2>/dev/null
"$bin/ds4-mkmodel" --out "$tmp/odd.gguf" --vocab-from "$models/stories260K.gguf" --dim 256 --layers 1 \
  --ff 704 --heads 4 --kv-heads 2 --type f16 --seed 6 2>/dev/null

pairs=""
add() {  # add NAME SOURCE [OPTIONS...] TYPE : quantize, dequantize, remember the pair
  local name=$1 source=$2
  shift 2
  local type=${*: -1}
  quantize "${@:1:$#-1}" "$source" "$tmp/$name.gguf" "$type"
  quantize --allow-requantize "$tmp/$name.gguf" "$tmp/$name.f32.gguf" F32
  pairs+="$tmp/$name.gguf=$tmp/$name.f32.gguf;"
}
for t in Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS; do
  add "pure_$t" "$tmp/f16.gguf" --pure "$t"
done
for t in Q4_K_M Q5_K_M Q3_K_M Q2_K; do
  add "mix_$t" "$tmp/f16.gguf" "$t"
  add "odd_$t" "$tmp/odd.gguf" "$t"
done
# The output and token embeddings in other types than the rest.
add emb_types "$tmp/f16.gguf" --output-tensor-type q8_0 --token-embedding-type q5_k Q4_K_M
# MXFP4 (DeepSeek V4's expert type): llama-quantize writes it only for the
# experts of a mixture of experts (MXFP4_MOE), so a small qwen3moe.
"$bin/ds4-mkmodel" --out "$tmp/moe.gguf" --vocab-from "$models/stories260K.gguf" --arch qwen3moe --dim 256 \
  --layers 2 --ff 512 --heads 4 --kv-heads 2 --experts 8 --experts-used 2 --expert-ff 256 --type f16 --seed 7 2>/dev/null
add moe_mxfp4 "$tmp/moe.gguf" MXFP4_MOE

out=$(DS4_QUANT_PAIRS=$pairs "$bin/ds4_unit_tests" -tc='quants: dequantize_row equals*' -s 2>&1) || {
  echo "$out" >&2
  fail "ds4's dequantization differs from llama.cpp's"
}
summary=$(grep -o 'tensors equal to llama.cpp.s, by type: .*' <<<"$out") || { echo "$out" >&2; fail "no summary"; }
echo "ok: $summary"
for t in Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS MXFP4; do
  grep -q " $t:" <<<" ${summary#*: }" || fail "no $t tensor was checked"
done
echo "ok: every type dequantizes as llama.cpp's does"
