#!/usr/bin/env bash
# CPU speed: ds4-worker bench against llama.cpp's llama-bench (the peer,
# ../shared/peers/llama.cpp) on the same files, in the same run, alternated.
#   bench/cpu.sh [THREADS=2] [REPS=3] [ROUNDS=3] [SETS="207m-f16 207m-q8_0 1b-q4_k_m"]
# Files, made under build/models/ when missing:
#   207m-f16, 207m-q8_0: the 207M llama of issue 2 (1024 wide, 16 layers, ff 2816,
#     16 heads), by ds4-mkmodel;
#   1b-q4_k_m (and 1b-q5_k_m): ds4-mkmodel's 1b preset (Llama-3-shaped) in F16,
#     quantized by the peer's llama-quantize;
#   moe-q4_k_m (moe-TYPE): a small qwen3moe (1024 wide, 8 layers, 32 experts of
#     width 512, 4 a token), quantized the same way.
# Each round measures ds4 and then llama.cpp on each file (REPS repetitions
# each). A shared machine's neighbours slow whole stretches of a run, so
# every round prints its own ratios and the summary takes the median of the
# rounds' ratios: one slow stretch moves it by one round at most. The first
# lines say which kernel table and decode walk ds4 ran and which CPU variant llama.cpp loaded,
# and the machine's load (uptime) before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
reps=${2:-3}
rounds=${3:-3}
sets=${4:-207m-f16 207m-q8_0 1b-q4_k_m}
bin=${DS4_BIN:-build/bin}
vocab=${DS4_MODELS:-../shared/models}/stories260K.gguf
peer=${DS4_PEER:-../shared/peers/llama.cpp/bin}
mkdir -p build/models
model_of() {  # the file of a set, made when missing
  local s=$1 f=build/models/$1.gguf
  if [ ! -f "$f" ]; then
    local preset=${s%%-*} type=${s#*-}
    local shape=(--preset "$preset")
    [ "$preset" = moe ] && shape=(--arch qwen3moe --dim 1024 --layers 8 --ff 512 --heads 16 --experts 32
      --experts-used 4 --expert-ff 512)
    case $type in
      f16 | f32 | bf16 | q8_0) "$bin/ds4-mkmodel" --out "$f" --vocab-from "$vocab" "${shape[@]}" --type "$type" >&2 ;;
      *)
        local src=build/models/$preset-f16.gguf
        [ -f "$src" ] || "$bin/ds4-mkmodel" --out "$src" --vocab-from "$vocab" "${shape[@]}" --type f16 >&2
        "$peer/llama-quantize" "$src" "$f" "${type^^}" >"$f.quantize.log" 2>&1 ||
          { tail -20 "$f.quantize.log" >&2; exit 1; }
        ;;
    esac
  fi
  echo "$f"
}
have_llama=0
if [ -x "$peer/llama-bench" ]; then
  have_llama=1
else
  echo "bench: $peer/llama-bench is missing (set DS4_PEER): ds4 figures only" >&2
fi
results=$(mktemp)
trap 'rm -f "$results"' EXIT
echo "load before: $(uptime)"
# ds4 reads its weights from shared memory, llama.cpp from the file's page
# cache: which of the two the kernel gives 2 MiB pages decides much of the
# decode speed (ds4's figure below says how much of its segment had them).
echo "/dev/shm: $(findmnt -no OPTIONS /dev/shm 2>/dev/null); shmem_enabled: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null)"
for s in $sets; do model_of "$s" >/dev/null; done
for r in $(seq 1 "$rounds"); do
  for s in $sets; do
    f=$(model_of "$s")
    ds4=$("$bin/ds4-worker" bench --model "$f" -p 128 -n 128 -r "$reps" --threads "$threads")
    [ "$r" = 1 ] && echo "ds4 on $s: $(python3 -c 'import json,sys; j = json.loads(sys.argv[1]); print(j["backend"] + ", %d of %d MiB of its segment in 2 MiB pages" % (j["huge_page_bytes"] >> 20, j["weights_bytes"] >> 20))' "$ds4")"
    echo "{\"round\":$r,\"set\":\"$s\",\"engine\":\"ds4\",\"result\":$ds4}" >>"$results"
    if [ $have_llama = 1 ]; then
      out=$("$peer/llama-bench" -m "$f" -p 128 -n 128 -r "$reps" -t "$threads" -o jsonl 2>"$results.err") ||
        { cat "$results.err" >&2; exit 1; }
      [ "$r" = 1 ] && echo "llama.cpp on $s: $(grep -o 'loaded CPU backend from [^ ]*' "$results.err" | head -1)"
      echo "$out" | python3 -c '
import json, sys
r = {}
for line in sys.stdin:
    t = json.loads(line)
    r["pp_tok_s" if t["n_prompt"] else "tg_tok_s"] = t["avg_ts"]
print(json.dumps(r))' | sed "s/^/{\"round\":$r,\"set\":\"$s\",\"engine\":\"llama.cpp\",\"result\":/; s/\$/}/" >>"$results"
    fi
  done
  echo "round $r done: $(uptime)"
done
rm -f "$results.err"
python3 - "$results" "$sets" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
def fig(s, engine, key):
    return [r["result"][key] for r in rows if r["set"] == s and r["engine"] == engine]
for s in sys.argv[2].split():
    parts = []
    for key, label in (("pp_tok_s", "pp128"), ("tg_tok_s", "tg128")):
        d, l = fig(s, "ds4", key), fig(s, "llama.cpp", key)
        text = f"{label} ds4 median {statistics.median(d):.1f} tok/s"
        if l:
            ratios = [a / b for a, b in zip(d, l)]
            text += (f", llama.cpp {statistics.median(l):.1f}; ratio per round "
                     + " ".join(f"{x:.2f}" for x in ratios) + f", median {statistics.median(ratios):.2f}x")
        parts.append(text)
    print(f"{s}: " + "; ".join(parts))
PY
