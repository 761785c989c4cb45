#!/usr/bin/env bash
# Installs the Debian packages ds4 needs, then configures and builds.
# Idempotent: when everything is present it only rebuilds.
#   scripts/setup.sh                     the service's and the tests' packages + build (build/)
#   scripts/setup.sh --service           the service's packages only (what scripts/run.sh uses)
#   scripts/setup.sh [--service] --no-build   packages only
# The full build configures the tests in (DS4_TESTS=ON); a build/ that
# scripts/run.sh configured without them gets them then.
set -euo pipefail
cd "$(dirname "$0")/.."

service=0 build=1
for arg in "$@"; do
  case $arg in
    --service) service=1 ;;
    --no-build) build=0 ;;
    *) echo "usage: scripts/setup.sh [--service] [--no-build]" >&2; exit 2 ;;
  esac
done

# What building and running the service needs (the README's quick start and
# its systemd units: the user manager and the user bus the supervisor talks to).
packages=(
  build-essential cmake ninja-build pkg-config git
  libboost-dev libsystemd-dev libyaml-cpp-dev nlohmann-json3-dev
  systemd dbus dbus-user-session
  curl                       # the README's first request
)
# What the tests add.
test_packages=(
  doctest-dev
  clang                      # libFuzzer targets (GGUF reader, proxy requests, worker protocol)
  procps                     # pgrep and pkill in the integration tests
  jq python3 python3-yaml    # integration tests (yaml: the Prometheus config check)
  chromium                   # the status page's browser test (driven by playwright-core, no browser download)
)
((service)) || packages+=("${test_packages[@]}")
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js and npm drive the real OpenAI / Anthropic SDK tests; any node >= 18 will do.
if ((!service)) && { ! command -v node >/dev/null || ! command -v npm >/dev/null; }; then
  missing+=(nodejs npm)
fi
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

((build)) || exit 0

if ((service)); then
  [ -f build/build.ninja ] || cmake -S . -B build -G Ninja -DDS4_TESTS=OFF
  cmake --build build --target ds4-programs
else
  cmake -S . -B build -G Ninja -DDS4_TESTS=ON >/dev/null
  cmake --build build
fi
