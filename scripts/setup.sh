#!/usr/bin/env bash
# Installs every Debian package ds4's build and tests need, then configures
# and builds. Idempotent: when everything is present it only rebuilds.
#   scripts/setup.sh            packages + build (build/)
#   scripts/setup.sh --no-build packages only
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ninja-build pkg-config git
  libboost-dev libsystemd-dev libyaml-cpp-dev doctest-dev nlohmann-json3-dev
  clang                      # libFuzzer target for the GGUF reader
  systemd dbus dbus-user-session procps   # real user manager + journald in tests
  curl jq python3 python3-yaml   # integration tests (yaml: the Prometheus config check)
  chromium                   # the status page's browser test (driven by playwright-core, no browser download)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js and npm drive the real OpenAI / Anthropic SDK tests; any node >= 18 will do.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  missing+=(nodejs npm)
fi
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

[ "${1:-}" = "--no-build" ] && exit 0

if [ ! -f build/build.ninja ]; then
  cmake -S . -B build -G Ninja
fi
cmake --build build
