#!/usr/bin/env bash
# ds4-mkmodel writes synthetic models that llama.cpp itself loads and runs:
# one small model per weight type, each generated from with llama.cpp (through
# the npm package node-llama-cpp). Also: bad arguments fail cleanly.
#
# Environment: DS4_BIN (folder with ds4-mkmodel), DS4_MODELS (folder with
# stories260K.gguf), DS4_SRC (source tree; default: two folders up).
# node-llama-cpp comes from $DS4_NODE_MODULES or tests/js/node_modules
# (scripts/test.sh installs it there); without it the llama.cpp part is skipped (exit 77).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=${DS4_SRC:-$(cd "$here/../.." && pwd)}
bin=${DS4_BIN:?DS4_BIN must name the folder holding ds4-mkmodel}
models=${DS4_MODELS:?DS4_MODELS must name the folder holding stories260K.gguf}
mkmodel=$bin/ds4-mkmodel
vocab=$models/stories260K.gguf

fail() { echo "FAIL: $*" >&2; exit 1; }
[[ -x $mkmodel ]] || fail "$mkmodel is missing (build the ds4-mkmodel target)"
[[ -r $vocab ]] || fail "$vocab is missing"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# --- bad arguments: nonzero exit and a message naming the problem ---------
expect_error() {  # expect_error PATTERN ARGS...
  local pattern=$1; shift
  local out rc=0
  out=$("$mkmodel" "$@" 2>&1) || rc=$?
  [[ $rc -ne 0 ]] || fail "ds4-mkmodel $* succeeded, expected an error"
  grep -q -- "$pattern" <<<"$out" || fail "ds4-mkmodel $*: message '$out' lacks '$pattern'"
  echo "ok: error for $*: $out"
}
small=(--dim 64 --layers 2 --ff 192 --heads 4 --kv-heads 2)
expect_error "unknown type 'q4_0'" --out "$tmp/x.gguf" --vocab-from "$vocab" "${small[@]}" --type q4_0
expect_error "not divisible by --heads" --out "$tmp/x.gguf" --vocab-from "$vocab" \
  --dim 66 --layers 2 --ff 192 --heads 4
expect_error "not divisible by --kv-heads" --out "$tmp/x.gguf" --vocab-from "$vocab" \
  --dim 64 --layers 2 --ff 192 --heads 4 --kv-heads 3
expect_error "--vocab-from: $tmp/missing.gguf: cannot open" --out "$tmp/x.gguf" \
  --vocab-from "$tmp/missing.gguf" "${small[@]}"
expect_error "--vocab-from is required" --out "$tmp/x.gguf" "${small[@]}"
expect_error "multiples of 32" --out "$tmp/x.gguf" --vocab-from "$vocab" \
  --dim 64 --layers 1 --ff 100 --heads 4 --type q8_0
expect_error "unknown option '--bogus'" --out "$tmp/x.gguf" --vocab-from "$vocab" --bogus 1
[[ ! -e $tmp/x.gguf ]] || fail "a failed run left $tmp/x.gguf behind"

# --- one model per type, written deterministically ------------------------
types=(f32 f16 bf16 q8_0)
for t in "${types[@]}"; do
  "$mkmodel" --out "$tmp/m_$t.gguf" --vocab-from "$vocab" "${small[@]}" --type "$t" --seed 7 \
    --ctx 512 --name "mk-$t" 2>"$tmp/m_$t.log" || { cat "$tmp/m_$t.log" >&2; fail "ds4-mkmodel --type $t"; }
done
"$mkmodel" --out "$tmp/again.gguf" --vocab-from "$vocab" "${small[@]}" --type f16 --seed 7 \
  --ctx 512 --name mk-f16 2>/dev/null
cmp -s "$tmp/m_f16.gguf" "$tmp/again.gguf" || fail "same arguments and seed gave different files"
echo "ok: ds4-mkmodel wrote ${types[*]} models; same seed, same bytes"

# --- llama.cpp loads and runs each ----------------------------------------
node_modules=""
for dir in ${DS4_NODE_MODULES:-} "$src/tests/js/node_modules"; do
  if [[ -d $dir/node-llama-cpp ]]; then node_modules=$dir; break; fi
done
if ! command -v node >/dev/null; then
  echo "SKIP: node is not installed; cannot run llama.cpp through node-llama-cpp" >&2
  exit 77
fi
if [[ -z $node_modules ]]; then
  echo "SKIP: node-llama-cpp not found (set DS4_NODE_MODULES or npm-install it into tests/js)" >&2
  exit 77
fi

declare -A first_token
for t in "${types[@]}"; do
  out=$(DS4_NODE_MODULES=$node_modules timeout 300 node "$src/tests/tools/llamacpp_generate.mjs" \
          "$tmp/m_$t.gguf" 8 "Once upon a time" 2>"$tmp/node_$t.log") ||
    { cat "$tmp/node_$t.log" >&2; fail "llama.cpp could not run the $t model"; }
  # Eight tokens, all inside the 512-token vocabulary.
  node -e '
    const r = JSON.parse(process.argv[1]);
    if (r.tokens.length !== 8 || !r.tokens.every(t => Number.isInteger(t) && t >= 0 && t < 512))
      process.exit(1);' "$out" || fail "llama.cpp output for the $t model is wrong: $out"
  echo "ok: llama.cpp ran the $t model: $out"
  first_token[$t]=$(node -e 'console.log(JSON.parse(process.argv[1]).tokens[0])' "$out")
done

# Logits have a clear argmax (std ~3), so the types' small rounding
# differences leave llama.cpp's greedy choice of the first token unchanged.
for t in f16 bf16 q8_0; do
  [[ ${first_token[$t]} == "${first_token[f32]}" ]] ||
    fail "first greedy token of the $t model (${first_token[$t]}) differs from f32's (${first_token[f32]})"
done
echo "PASS"
