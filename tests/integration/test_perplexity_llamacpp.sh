#!/usr/bin/env bash
# ds4-worker perplexity against llama.cpp's llama-perplexity on the same files,
# text and context:
#  - stories260K (F32) and a random F32 model of stories' vocabulary: the final
#    PPL and each chunk's running PPL agree within 2e-3 relative. Both engines
#    run F32 weights and an F16 KV cache; what differs is the order of their
#    sums (llama.cpp's matrix products, ds4's rows): seen 8e-4 on stories'
#    first chunk (the fewest positions) and 5e-5 on its final PPL; the random
#    model agrees to all printed digits.
#  - --save-logits from the F32 random model, then --kl-divergence of its
#    Q8_0 copy (llama-quantize): the mean KLD is positive and small, the same
#    top above 90%, and at most 1.1x llama-perplexity's own KLD for the same
#    pair (seen: ds4 0.000845, llama.cpp 0.000850).
#  - the F32 model against its own saved log-probs: KLD below 1e-6, 100% same
#    top, PPL(Q) = PPL(base).
#  - a base of another context or text, or a file that is none, is refused,
#    saying what differs.
#
# Environment: DS4_BIN (folder with ds4-worker and ds4-mkmodel), DS4_MODELS
# (folder with stories260K.gguf), DS4_SRC (source tree), DS4_PEER (the
# llama.cpp peer's bin folder; default ../shared/peers/llama.cpp/bin).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export DS4_SRC=${DS4_SRC:-$(cd "$here/../.." && pwd)}
bin=${DS4_BIN:?DS4_BIN must name the folder holding ds4-worker and ds4-mkmodel}
models=${DS4_MODELS:?DS4_MODELS must name the folder holding stories260K.gguf}
source "$here/lib/peer.sh"
peer_require

fail() { echo "FAIL: $*" >&2; exit 1; }
[[ -x $peer_bin/llama-perplexity ]] || { echo "SKIP: no llama-perplexity at $peer_bin" >&2; exit 77; }
[[ -x $bin/ds4-worker ]] || fail "$bin/ds4-worker is missing (build the ds4-worker target)"
[[ -x $bin/ds4-mkmodel ]] || fail "$bin/ds4-mkmodel is missing (build the ds4-mkmodel target)"
stories=$models/stories260K.gguf
[[ -f $stories ]] || { echo "SKIP: no $stories" >&2; exit 77; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Some 29 KB of English (about 9,000 of stories' tokens): the repository's own docs.
cat "$DS4_SRC/README.md" "$DS4_SRC/docs/engine.md" | head -c 30000 >"$tmp/text.txt"
ctx=128 chunks=8

ds4_ppl() { "$bin/ds4-worker" perplexity --device cpu -t 2 --context $ctx "$@" 2>"$tmp/ds4.err" || { cat "$tmp/ds4.err" >&2; fail "ds4-worker perplexity $*"; }; }
peer_ppl() { "$peer_bin/llama-perplexity" -t 2 -c $ctx "$@" 2>&1 || fail "llama-perplexity $*"; }
final() { sed -n 's/.*Final estimate: PPL = \([0-9.]*\).*/\1/p' | tail -1; }
running() { grep -o '\[[0-9]*\][0-9.]*' | sed 's/.*\]//'; }
stat_of() { sed -n "s/^$1 *: *\([-0-9.]*\).*/\1/p" | tail -1; }
# close A B TOL: |A-B| <= TOL * |B|
close() { python3 -c "import sys; a,b,t=map(float,sys.argv[1:]); sys.exit(0 if abs(a-b) <= t*abs(b) else 1)" "$1" "$2" "$3"; }
check() { python3 -c "import sys; sys.exit(0 if ($1) else 1)" || fail "$2"; }

compare_ppl() {  # compare_ppl MODEL NAME
  local ours theirs a b i=0
  ours=$(ds4_ppl -m "$1" -f "$tmp/text.txt" --chunks $chunks)
  theirs=$(peer_ppl -m "$1" -f "$tmp/text.txt" --chunks $chunks)
  a=$(final <<<"$ours")
  b=$(final <<<"$theirs")
  [[ -n $a && -n $b ]] || fail "$2: no final PPL (ds4: '$a', llama.cpp: '$b')"
  echo "$2: ds4 PPL $a, llama-perplexity $b"
  close "$a" "$b" 2e-3 || fail "$2: ds4's PPL $a is not within 2e-3 of llama-perplexity's $b"
  mapfile -t ra < <(running <<<"$ours")
  mapfile -t rb < <(running <<<"$theirs")
  [[ ${#ra[@]} -eq $chunks && ${#rb[@]} -eq $chunks ]] || fail "$2: expected $chunks chunks, got ${#ra[@]} and ${#rb[@]}"
  for ((i = 0; i < chunks; i++)); do
    close "${ra[i]}" "${rb[i]}" 2e-3 || fail "$2: chunk $((i + 1)): ds4 ${ra[i]}, llama-perplexity ${rb[i]}"
  done
}

compare_ppl "$stories" "stories260K F32"

# stories' feed-forward (172) is no multiple of Q8_0's block: a random model of
# its vocabulary, whose rows are.
"$bin/ds4-mkmodel" --out "$tmp/f32.gguf" --vocab-from "$stories" --dim 256 --layers 2 --ff 768 --heads 4 \
  --kv-heads 2 --type f32 --seed 5 2>/dev/null
"$peer_bin/llama-quantize" "$tmp/f32.gguf" "$tmp/q8.gguf" Q8_0 >"$tmp/quantize.log" 2>&1 ||
  { tail -5 "$tmp/quantize.log" >&2; fail "llama-quantize Q8_0"; }
compare_ppl "$tmp/f32.gguf" "random F32"

ds4_ppl -m "$tmp/f32.gguf" -f "$tmp/text.txt" --chunks $chunks --save-logits "$tmp/base.bin" >/dev/null
# Header (24 bytes), the tokens, and per scored position n_vocab + 6 uint16.
n_vocab=512 per=$((ctx - 1 - ctx / 2))
size=$(stat -c %s "$tmp/base.bin")
[[ $size -eq $((24 + 4 * ctx * chunks + chunks * per * (n_vocab + 6) * 2)) ]] || fail "base.bin has $size bytes"

self=$(ds4_ppl -m "$tmp/f32.gguf" --kl-divergence "$tmp/base.bin")
kld=$(stat_of "Mean    KLD" <<<"$self")
top=$(sed -n 's/^Same top p: *\([0-9.]*\).*/\1/p' <<<"$self")
ratio=$(stat_of "Mean PPL(Q)\/PPL(base)" <<<"$self")
echo "F32 against itself: KLD $kld, same top $top%, PPL ratio $ratio"
check "0 <= $kld < 1e-6" "F32 against its own base: KLD $kld"
check "$top == 100" "F32 against its own base: same top $top%"
check "abs($ratio - 1) < 1e-6" "F32 against its own base: PPL ratio $ratio"

q8=$(ds4_ppl -m "$tmp/q8.gguf" -f "$tmp/text.txt" --kl-divergence "$tmp/base.bin")
kld=$(stat_of "Mean    KLD" <<<"$q8")
top=$(sed -n 's/^Same top p: *\([0-9.]*\).*/\1/p' <<<"$q8")
peer_ppl -m "$tmp/f32.gguf" -f "$tmp/text.txt" --chunks $chunks --kl-divergence-base "$tmp/peer-base.bin" >/dev/null
peer=$(peer_ppl -m "$tmp/q8.gguf" --chunks $chunks --kl-divergence-base "$tmp/peer-base.bin" --kl-divergence)
peer_kld=$(stat_of "Mean    KLD" <<<"$peer")
echo "Q8_0 against F32: ds4 KLD $kld (same top $top%), llama-perplexity KLD $peer_kld"
check "0 < $kld < 0.01" "Q8_0 against F32: KLD $kld"
check "$top > 90" "Q8_0 against F32: same top $top%"
check "$kld <= 1.1 * $peer_kld" "Q8_0 against F32: ds4's KLD $kld above 1.1x llama-perplexity's $peer_kld"

# --json: the same figures as one JSON line on stdout.
json=$("$bin/ds4-worker" perplexity --device cpu -t 2 -m "$tmp/q8.gguf" --context $ctx --kl-divergence "$tmp/base.bin" --json 2>/dev/null)
python3 -c "import json, sys; j = json.loads(sys.argv[1]); sys.exit(0 if abs(j['kld_mean'] - float(sys.argv[2])) < 1e-6 and j['chunks'] == $chunks and j['positions'] == $chunks * $per else 1)" \
  "$json" "$kld" || fail "--json: $json (mean KLD $kld)"
json=$("$bin/ds4-worker" perplexity --device cpu -t 2 -m "$stories" --context $ctx -f "$tmp/text.txt" --chunks 2 --json 2>/dev/null)
python3 -c "import json, sys; j = json.loads(sys.argv[1]); sys.exit(0 if j['ppl'] > 1 and j['ppl_error'] > 0 and j['chunks'] == 2 else 1)" \
  "$json" || fail "--json: $json"

# Options that cannot go together, a text too short, a base of another
# context or text, or no base at all, are refused.
refused() {  # refused WHAT ARGS...: ds4-worker perplexity ARGS fails saying WHAT
  local what=$1
  shift
  if "$bin/ds4-worker" perplexity --device cpu -m "$tmp/f32.gguf" "$@" >/dev/null 2>"$tmp/err"; then
    fail "perplexity $* was taken"
  fi
  grep -q -- "$what" "$tmp/err" || fail "perplexity $*: $(cat "$tmp/err") (expected '$what')"
}
refused "text to measure is missing" --context $ctx
refused "give one of --save-logits and --kl-divergence" --context $ctx -f "$tmp/text.txt" \
  --save-logits "$tmp/x.bin" --kl-divergence "$tmp/base.bin"
head -c 300 "$tmp/text.txt" >"$tmp/short.txt"
refused "needs at least 256" --context $ctx -f "$tmp/short.txt"
refused "holds $chunks chunks" --context $ctx --kl-divergence "$tmp/base.bin" --chunks 9
if "$bin/ds4-worker" perplexity --device cpu -m "$tmp/f32.gguf" --context 64 --kl-divergence "$tmp/base.bin" \
  >/dev/null 2>"$tmp/err"; then fail "a base of context $ctx was taken with --context 64"; fi
grep -q "context of $ctx" "$tmp/err" || fail "context mismatch: $(cat "$tmp/err")"
head -c 5000 "$DS4_SRC/docs/service.md" >"$tmp/other.txt"
cat "$tmp/text.txt" >>"$tmp/other.txt"
if "$bin/ds4-worker" perplexity --device cpu -m "$tmp/f32.gguf" --context $ctx -f "$tmp/other.txt" \
  --kl-divergence "$tmp/base.bin" >/dev/null 2>"$tmp/err"; then fail "a base of another text was taken"; fi
grep -q "another text" "$tmp/err" || fail "text mismatch: $(cat "$tmp/err")"
printf 'not a base' >"$tmp/junk.bin"
if "$bin/ds4-worker" perplexity --device cpu -m "$tmp/f32.gguf" --context $ctx --kl-divergence "$tmp/junk.bin" \
  >/dev/null 2>"$tmp/err"; then fail "a file that is no base was taken"; fi
grep -q "not a file of log-probs" "$tmp/err" || fail "junk base: $(cat "$tmp/err")"
echo "PASS"
