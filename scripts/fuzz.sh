#!/usr/bin/env bash
# Fuzzes the parsers that take outside input: the GGUF reader (seeded with the
# real model and its header alone) and the proxy's request parsing and
# protocol translation (seeded with OpenAI and Anthropic requests). Builds
# tests/fuzz with clang (libFuzzer, ASan, UBSan) in build-fuzz/ and runs each
# for a bounded time: half of [seconds] each. Exits non-zero on any crash; the
# input that caused it is left in build-fuzz/fuzz-artifacts/.
#   scripts/fuzz.sh [seconds]     default 60
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-60}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
  echo "usage: scripts/fuzz.sh [seconds]   (a positive whole number, default 60)" >&2
  exit 2
fi
models="${DS4_MODELS:-$(pwd)/../shared/models}"
seed="$models/stories260K.gguf"
[ -f "$seed" ] || { echo "fuzz: seed $seed is missing" >&2; exit 1; }
command -v clang++ >/dev/null || { echo "fuzz: clang++ is missing (scripts/setup.sh installs it)" >&2; exit 1; }

build=build-fuzz
if [ ! -f "$build/build.ninja" ]; then
  CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DDS4_FUZZ=ON -DDS4_CUDA=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
cmake --build "$build" --target fuzz_gguf fuzz_proxy_request -j"${JOBS:-2}"
half=$(( (seconds + 1) / 2 ))

corpus="$build/fuzz-corpus/gguf"
artifacts="$build/fuzz-artifacts"
mkdir -p "$corpus" "$artifacts"
cp -f "$seed" "$corpus/stories260K.gguf"
# The metadata and tensor directory alone: a small seed whose mutations all
# land where the parser works (the first tensor's data starts after them).
head -c 16384 "$seed" >"$corpus/stories260K-head.gguf"

# Inputs are capped at 64 KiB (the full model seed is cut there): everything the
# reader parses lies in the first 14 KiB, and small inputs keep it fast.
"$build/bin/fuzz_gguf" "$corpus" -max_total_time="$half" -timeout=10 -rss_limit_mb=2048 \
  -malloc_limit_mb=1024 -max_len=65536 -artifact_prefix="$artifacts/" -print_final_stats=1

corpus="$build/fuzz-corpus/proxy"
mkdir -p "$corpus"
# The first byte picks the endpoint (0 chat, 1 completions, 2 messages).
printf '\000%s' '{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Once upon a time"}],"max_tokens":16,"stream":true,"stream_options":{"include_usage":true},"stop":["\n"],"logprobs":true,"top_logprobs":2,"temperature":0.7,"seed":3}' >"$corpus/chat.json"
printf '\001%s' '{"model":"m","prompt":"Once upon a time","max_tokens":8,"top_k":40,"top_p":0.9,"min_p":0.05}' >"$corpus/completion.json"
printf '\000%s' '{"messages":[{"role":"user","content":"Hi \u00e9"}],"max_tokens":4,"temperature":0}' >"$corpus/chat-common.json"
printf '\002%s' '{"model":"m","system":"Be brief.","messages":[{"role":"user","content":[{"type":"text","text":"Hi"}]}],"max_tokens":16,"stop_sequences":["."],"stream":true}' >"$corpus/messages.json"
"$build/bin/fuzz_proxy_request" "$corpus" -max_total_time="$half" -timeout=10 -rss_limit_mb=2048 \
  -malloc_limit_mb=1024 -max_len=65536 -artifact_prefix="$artifacts/" -print_final_stats=1
