#!/usr/bin/env bash
# Sets up and runs the whole ds4 service in the foreground: the supervisor
# (model store, workers, the OpenAI/Anthropic proxy) with the embedded defaults.
#   scripts/run.sh [CONFIG]
# It installs the packages the service needs (scripts/setup.sh --service; the
# tests' are scripts/test.sh's) and builds, in Release, every program that
# `cmake --install` installs (the CMake target ds4-programs), so that the
# README's next step, the install, finds them all; scripts/test.sh builds the
# tests. Without CONFIG it serves ../shared/models/stories260K.gguf when that
# file is there, else config/ds4.yaml as shipped (no model configured: a small
# synthetic model with random weights, said loudly in the log). The address it
# serves is in the log's "proxy listening on" line (proxy.listen of the config).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --service --no-build
if [ ! -f build/build.ninja ]; then
  echo "run.sh: configuring build/ (Release)" >&2
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DDS4_TESTS=OFF >/dev/null
fi
targets=(ds4-programs)
if ! ninja -C build -n "${targets[@]}" | grep -q "no work to do"; then
  echo "run.sh: building ${targets[*]} in build/ (the first time takes about 6.5 minutes on 2 idle cores" \
       "with the CUDA backend; later runs rebuild only what changed)" >&2
  start=$SECONDS
  cmake --build build --target "${targets[@]}"
  echo "run.sh: built in $((SECONDS - start)) s" >&2
fi
config=${1:-}
if [ -z "$config" ]; then
  config=config/ds4.yaml
  if [ -f ../shared/models/stories260K.gguf ]; then
    config=build/run.yaml
    { echo "model:"; echo "  path: $(realpath ../shared/models/stories260K.gguf)"; echo "  name: stories"; } > "$config"
  fi
fi
echo "run.sh: ds4-supervisor --config $config (its 'proxy listening on' line gives the APIs' address)" >&2
exec build/bin/ds4-supervisor --config "$config"
