#!/usr/bin/env bash
# Fuzzes the GGUF reader: builds tests/fuzz with clang (libFuzzer, ASan, UBSan)
# in build-fuzz/ and runs it for a bounded time, seeded with the real model and
# its header alone. Exits non-zero on any crash; the input that caused it is
# left in build-fuzz/fuzz-artifacts/.
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
cmake --build "$build" --target fuzz_gguf -j"${JOBS:-2}"

corpus="$build/fuzz-corpus/gguf"
artifacts="$build/fuzz-artifacts"
mkdir -p "$corpus" "$artifacts"
cp -f "$seed" "$corpus/stories260K.gguf"
# The metadata and tensor directory alone: a small seed whose mutations all
# land where the parser works (the first tensor's data starts after them).
head -c 16384 "$seed" >"$corpus/stories260K-head.gguf"

# Inputs are capped at 64 KiB (the full model seed is cut there): everything the
# reader parses lies in the first 14 KiB, and small inputs keep it fast.
exec "$build/bin/fuzz_gguf" "$corpus" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
  -malloc_limit_mb=1024 -max_len=65536 -artifact_prefix="$artifacts/" -print_final_stats=1
