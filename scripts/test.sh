#!/usr/bin/env bash
# Sets up (packages, build, test dependencies) and runs every test with ctest.
#   scripts/test.sh [ctest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Real-client tests use the npm packages (openai, @anthropic-ai/sdk) and a
# prebuilt llama.cpp (node-llama-cpp) as the reference implementation.
# Again when package.json changed since (a new test client: playwright-core).
if [ -f tests/js/package.json ] && { [ ! -d tests/js/node_modules ] ||
     [ tests/js/package.json -nt tests/js/node_modules/.package-lock.json ]; }; then
  (cd tests/js && npm install --no-audit --no-fund --loglevel=error) ||
    echo "test.sh: npm install failed; tests that need the npm packages will skip" >&2
fi
# The coding-agent CLIs (Claude Code, Codex, pi, OpenCode) for test_agent_clients
# (install, not ci: the lock holds only the platform binaries the registry had).
if [ -f tests/agents/package.json ] && [ ! -d tests/agents/node_modules ]; then
  (cd tests/agents && npm install --no-audit --no-fund --loglevel=error) ||
    echo "test.sh: npm install in tests/agents failed; test_agent_clients will skip" >&2
fi
cd build
ctest --output-on-failure "$@"
