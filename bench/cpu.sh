#!/usr/bin/env bash
# CPU speed: ds4-worker bench against llama.cpp (the prebuilt node-llama-cpp,
# when installed) on the same synthetic files, in the same run, interleaved.
#   bench/cpu.sh [THREADS=2] [REPS=3] [ROUNDS=3]
# Models: the 207M llama of issue 2 (1024 wide, 16 layers, ff 2816, 16 heads),
# F16 and Q8_0, made by ds4-mkmodel under build/models/ when missing.
# Each round measures ds4 and then llama.cpp on each file (REPS repetitions
# each, as llama-bench). A shared machine's neighbours slow whole stretches
# of a run, so every round prints its own ratios and the summary takes the
# median of the rounds' ratios: one slow stretch moves it by one round at most.
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
reps=${2:-3}
rounds=${3:-3}
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
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for r in $(seq 1 "$rounds"); do
  for t in f16 q8_0; do
    f=build/models/207m-$t.gguf
    ds4=$("$bin/ds4-worker" bench --model "$f" -p 128 -n 128 -r "$reps" --threads "$threads")
    echo "{\"round\":$r,\"type\":\"$t\",\"engine\":\"ds4\",\"result\":$ds4}" | tee -a "$results"
    if [ $have_llama = 1 ]; then
      ref=$(node tests/tools/llamacpp_bench.mjs "$f" 128 128 "$reps" "$threads")
      echo "{\"round\":$r,\"type\":\"$t\",\"engine\":\"llama.cpp\",\"result\":$ref}" | tee -a "$results"
    fi
  done
done
python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
def fig(t, engine, key):
    return [r["result"][key] for r in rows if r["type"] == t and r["engine"] == engine]
for t in ("f16", "q8_0"):
    parts = []
    for key, label in (("pp_tok_s", "pp128"), ("tg_tok_s", "tg128")):
        d, l = fig(t, "ds4", key), fig(t, "llama.cpp", key)
        text = f"{label} ds4 median {statistics.median(d):.1f} tok/s"
        if l:
            ratios = [a / b for a, b in zip(d, l)]
            text += (f", llama.cpp {statistics.median(l):.1f}; ratio per round "
                     + " ".join(f"{x:.2f}" for x in ratios) + f", median {statistics.median(ratios):.2f}x")
        parts.append(text)
    print(f"{t}: " + "; ".join(parts))
PY
