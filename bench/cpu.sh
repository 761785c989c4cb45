#!/usr/bin/env bash
# CPU speed: ds4-worker bench against llama.cpp (the prebuilt node-llama-cpp,
# when installed) on the same synthetic files, in the same run, interleaved.
#   bench/cpu.sh [THREADS=2] [REPS=3]
# Models: the 207M llama of issue 2 (1024 wide, 16 layers, ff 2816, 16 heads),
# F16 and Q8_0, made by ds4-mkmodel under build/models/ when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
reps=${2:-3}
bin=${DS4_BIN:-build/bin}
vocab=${DS4_MODELS:-../shared/models}/stories260K.gguf
mkdir -p build/models
for t in f16 q8_0; do
  f=build/models/207m-$t.gguf
  [ -f "$f" ] || "$bin/ds4-mkmodel" --out "$f" --vocab-from "$vocab" --preset 207m --type $t >&2
done
have_llama=0
if node -e 'import("./tests/tools/node_llama_cpp.mjs").then(m=>m.loadNodeLlamaCpp()).then(()=>process.exit(0),()=>process.exit(1))' 2>/dev/null; then
  have_llama=1
else
  echo "bench: node-llama-cpp not installed (npm install in tests/js): ds4 figures only" >&2
fi
for t in f16 q8_0; do
  f=build/models/207m-$t.gguf
  ds4=$("$bin/ds4-worker" bench --model "$f" -p 128 -n 128 -r "$reps" --threads "$threads")
  echo "{\"file\":\"$f\",\"ds4\":$ds4}"
  if [ $have_llama = 1 ]; then
    ref=$(node tests/tools/llamacpp_bench.mjs "$f" 128 128 "$reps" "$threads")
    echo "{\"file\":\"$f\",\"llama.cpp\":$ref}"
    python3 - "$ds4" "$ref" "$t" <<'PY'
import json, sys
d, r, t = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
print(f"{t}: pp {d['pp_tok_s']:.1f} vs {r['pp_tok_s']:.1f} tok/s = {d['pp_tok_s']/r['pp_tok_s']:.2f}x llama.cpp; "
      f"tg {d['tg_tok_s']:.1f} vs {r['tg_tok_s']:.1f} tok/s = {d['tg_tok_s']/r['tg_tok_s']:.2f}x llama.cpp")
PY
  fi
done
