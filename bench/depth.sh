#!/usr/bin/env bash
# Speed deep in a context (issue 25), against llama.cpp's llama-bench (the
# peer, ../shared/peers/llama.cpp) on the same file, in the same run,
# alternated: for each depth D, the prompt speed of P tokens and the
# generation speed of N tokens after D tokens already in the cache
# (`ds4-worker bench -d D`, `llama-bench -d D`).
#   bench/depth.sh [MODEL=build/models/207m-f16.gguf] [DEPTHS="0 4096 16384"] [ROUNDS=2] [P=512] [N=32]
# Each round measures ds4 and then llama.cpp at every depth (one repetition:
# llama-bench fills the depth again before each test); the summary is the
# median of the rounds' ratios. A depth of 16384 takes minutes per round
# on 2 threads. Environment: DS4_BIN, DS4_PEER, DS4_THREADS (2), DS4_KV_CACHE
# (f16; q8_0: ds4 --kv-cache q8_0 against llama-bench -fa 1 -ctk q8_0 -ctv q8_0).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-build/models/207m-f16.gguf}
depths=${2:-0 4096 16384}
rounds=${3:-2}
np=${4:-512}
ng=${5:-32}
bin=${DS4_BIN:-build/bin}
peer=${DS4_PEER:-../shared/peers/llama.cpp/bin}
threads=${DS4_THREADS:-2}
kv=${DS4_KV_CACHE:-f16}
ds4_kv=(--kv-cache "$kv")
peer_kv=()
[ "$kv" = f16 ] || peer_kv=(-fa 1 -ctk "$kv" -ctv "$kv")
[ -f "$model" ] || { echo "bench: $model is missing (bench/cpu.sh makes build/models/207m-f16.gguf)" >&2; exit 1; }
[ -x "$peer/llama-bench" ] || { echo "bench: $peer/llama-bench is missing (set DS4_PEER)" >&2; exit 1; }
results=$(mktemp)
trap 'rm -f "$results"' EXIT
echo "load before: $(uptime)"
echo "/dev/shm: $(findmnt -no OPTIONS /dev/shm 2>/dev/null); shmem_enabled: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null)"
for r in $(seq 1 "$rounds"); do
  for d in $depths; do
    ds4=$("$bin/ds4-worker" bench --model "$model" -p "$np" -n "$ng" -d "$d" -r 1 --threads "$threads" "${ds4_kv[@]}")
    [ "$r" = 1 ] && [ "$d" = "${depths%% *}" ] &&
      echo "ds4: $(python3 -c 'import json,sys; j = json.loads(sys.argv[1]); print(j["backend"] + ", %d of %d MiB of its segment in 2 MiB pages" % (j["huge_page_bytes"] >> 20, j["weights_bytes"] >> 20))' "$ds4")"
    llama=$("$peer/llama-bench" -m "$model" -p "$np" -n "$ng" -d "$d" -r 1 -t "$threads" "${peer_kv[@]}" -o json 2>"$results.err") ||
      { cat "$results.err" >&2; exit 1; }
    [ "$r" = 1 ] && [ "$d" = "${depths%% *}" ] && echo "llama.cpp: $(grep -o 'loaded CPU backend from [^ ]*' "$results.err" | head -1)"
    python3 - "$ds4" "$llama" "$d" "$r" >>"$results" <<'PY'
import json, sys
ds4, llama, d, r = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
pp = next(x["avg_ts"] for x in llama if x["n_prompt"] > 0)
tg = next(x["avg_ts"] for x in llama if x["n_gen"] > 0)
print(json.dumps({"round": r, "depth": d, "ds4_pp": ds4["pp_tok_s"], "ds4_tg": ds4["tg_tok_s"], "llama_pp": pp, "llama_tg": tg}))
PY
    tail -1 "$results" | python3 -c 'import json,sys; j=json.load(sys.stdin); print("round %d, depth %5d: pp ds4 %7.1f llama.cpp %7.1f, tg ds4 %6.1f llama.cpp %6.1f" % (j["round"], j["depth"], j["ds4_pp"], j["llama_pp"], j["ds4_tg"], j["llama_tg"]))'
  done
done
rm -f "$results.err"
echo "load after: $(uptime)"
python3 - "$results" "$np" "$ng" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"depth | pp{sys.argv[2]} ds4 / llama.cpp | tg{sys.argv[3]} ds4 / llama.cpp   (median of the rounds' ratios)")
for d in sorted({r["depth"] for r in rows}):
    rs = [r for r in rows if r["depth"] == d]
    pp = statistics.median(r["ds4_pp"] / r["llama_pp"] for r in rs)
    tg = statistics.median(r["ds4_tg"] / r["llama_tg"] for r in rs)
    print(f"{d:5d} | {pp:.2f}x ({statistics.median(r['ds4_pp'] for r in rs):.0f} / {statistics.median(r['llama_pp'] for r in rs):.0f}) "
          f"| {tg:.2f}x ({statistics.median(r['ds4_tg'] for r in rs):.1f} / {statistics.median(r['llama_tg'] for r in rs):.1f})")
PY
