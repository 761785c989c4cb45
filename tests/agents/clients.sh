# shellcheck shell=bash
# The four coding-agent CLIs of tests/agents/package.json, each pointed at a
# local server for one non-interactive turn, without a login and without
# touching the user's files. Source it; used by
# tests/integration/test_agent_clients.sh (against the ds4 proxy) and
# tests/agents/capture.sh (against tests/tools/capture_server.mjs).
#
#   AGENT_CLIENTS                       the client names: claude codex pi opencode
#   agent_check                         prints why the CLIs cannot run here (and
#                                       returns 1), or returns 0 (takes ~10 s: it
#                                       runs each native CLI's --version)
#   agent_run CLIENT URL KEY DIR [SECONDS [PROMPT]]
#       configures CLIENT under DIR (its HOME, config files, work folder: DIR
#       is created and owned by the caller) for the server at URL
#       (http://127.0.0.1:PORT, no /v1) with API key KEY, runs one turn of
#       PROMPT ("Say hi in one short sentence.") under a timeout of SECONDS
#       (180); stdout in DIR/out.txt, stderr in DIR/err.txt; returns the CLI's
#       exit status (124: timed out).
#
# How each is pointed at the server (none needs a login):
# - Claude Code (`claude -p`): ANTHROPIC_BASE_URL=URL and ANTHROPIC_API_KEY=KEY
#   (sent as x-api-key; in -p mode the key is used without the approval
#   prompt); CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC, DISABLE_AUTOUPDATER,
#   DISABLE_TELEMETRY, DISABLE_ERROR_REPORTING keep it off the network. Its
#   model stays the default (the proxy serves whatever name is asked for).
# - Codex CLI (`codex exec`): CODEX_HOME=DIR/codex with a config.toml whose
#   model_provider "ds4" has base_url URL/v1, wire_api "responses" (the only
#   one 0.171 has) and env_key DS4_API_KEY (sent as a Bearer token);
#   --skip-git-repo-check since the work folder is no git repository.
# - pi (`pi -p`): DIR/home/.pi/agent/models.json with a provider "ds4" of api
#   "openai-completions", baseUrl URL/v1, apiKey "DS4_API_KEY" (the name of
#   the variable that holds it); --model ds4/ds4; PI_OFFLINE=1 stops its
#   startup network calls (update check, telemetry).
# - OpenCode (`opencode run`): DIR/home/.config/opencode/opencode.json with a
#   provider "ds4" of npm "@ai-sdk/openai-compatible" (bundled in the binary:
#   nothing is installed at run time), options.baseURL URL/v1, options.apiKey
#   "{env:DS4_API_KEY}", model "ds4/ds4"; autoupdate false, share disabled,
#   OPENCODE_DISABLE_{AUTOUPDATE,MODELS_FETCH,LSP_DOWNLOAD,SHARE}=1.
# Every CLI runs under env -i with HOME=DIR/home; npm_config_registry and the
# HTTP(S)_PROXY/ALL_PROXY variables point at a closed local port, NO_PROXY at
# 127.0.0.1: a package install at run time, or a fetch from elsewhere (Codex
# 0.171 looks up github.com, api.github.com and chatgpt.com), fails at once
# instead of reaching the network (checked with strace: each CLI connects to
# the server and to that closed port only).

AGENT_CLIENTS=(claude codex pi opencode)
AGENT_DIR=${AGENT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
AGENT_BIN=$AGENT_DIR/node_modules/.bin

agent_check() {
  command -v node >/dev/null || { echo "node is not installed"; return 1; }
  node -e 'const [a, b] = process.versions.node.split(".").map(Number); process.exit(a > 20 || (a == 20 && b >= 6) ? 0 : 1)' ||
    { echo "node $(node --version) is older than 20.6 (pi needs it)"; return 1; }
  local c v
  for c in claude codex pi opencode; do
    [[ -x $AGENT_BIN/$c ]] || {
      echo "no $AGENT_BIN/$c: tests/agents/node_modules is not installed (scripts/test.sh runs npm install there)"
      return 1
    }
  done
  # A platform binary that npm did not install (none for this machine, or its
  # postinstall did not run) shows here, before ds4 is involved.
  local tmp rc=0
  tmp=$(mktemp -d /tmp/ds4-agent-check.XXXXXX) || return 1
  _agent_env "$tmp"
  mkdir -p "$tmp/home" "$tmp/tmp"
  for c in claude codex opencode; do
    v=$(timeout 60 "${AGENT_ENV[@]}" OPENCODE_DISABLE_AUTOUPDATE=1 "$AGENT_BIN/$c" --version 2>&1) || {
      echo "$c --version fails, so its package is not installed for this machine: $(head -c 300 <<<"$v")"
      rc=1
      break
    }
  done
  rm -rf "$tmp"
  return $rc
}

# The environment every CLI starts from: nothing of the caller's but PATH.
# shellcheck disable=SC2054  # the commas are in NO_PROXY's value
_agent_env() {
  local dir=$1
  AGENT_ENV=(env -i "PATH=$(dirname "$(command -v node)"):/usr/bin:/bin" "HOME=$dir/home" TERM=dumb NO_COLOR=1
             LANG=C.UTF-8 "TMPDIR=$dir/tmp" npm_config_registry=http://127.0.0.1:9/ npm_config_offline=true
             HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 ALL_PROXY=http://127.0.0.1:9
             http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9 all_proxy=http://127.0.0.1:9
             NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost)
}

_agent_config_codex() {
  local url=$1 dir=$2
  mkdir -p "$dir/codex"
  cat >"$dir/codex/config.toml" <<EOF
model = "ds4"
model_provider = "ds4"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.ds4]
name = "ds4"
base_url = "$url/v1"
wire_api = "responses"
env_key = "DS4_API_KEY"
request_max_retries = 1   # not 4: a refusal shows at once
stream_max_retries = 1
EOF
}

_agent_config_pi() {
  local url=$1 dir=$2
  mkdir -p "$dir/home/.pi/agent"
  cat >"$dir/home/.pi/agent/models.json" <<EOF
{
  "providers": {
    "ds4": {
      "baseUrl": "$url/v1",
      "api": "openai-completions",
      "apiKey": "DS4_API_KEY",
      "models": [{"id": "ds4"}]
    }
  }
}
EOF
}

_agent_config_opencode() {
  local url=$1 dir=$2
  mkdir -p "$dir/home/.config/opencode"
  cat >"$dir/home/.config/opencode/opencode.json" <<EOF
{
  "\$schema": "https://opencode.ai/config.json",
  "autoupdate": false,
  "share": "disabled",
  "model": "ds4/ds4",
  "provider": {
    "ds4": {
      "npm": "@ai-sdk/openai-compatible",
      "name": "ds4",
      "options": {"baseURL": "$url/v1", "apiKey": "{env:DS4_API_KEY}"},
      "models": {"ds4": {"name": "ds4"}}
    }
  }
}
EOF
}

agent_run() {
  local client=$1 url=$2 key=$3 dir=$4 secs=${5:-180} prompt=${6:-"Say hi in one short sentence."}
  mkdir -p "$dir/home" "$dir/tmp" "$dir/work"
  _agent_env "$dir"
  local cmd
  case $client in
    claude)
      cmd=("${AGENT_ENV[@]}" "ANTHROPIC_BASE_URL=$url" "ANTHROPIC_API_KEY=$key"
           CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 DISABLE_TELEMETRY=1
           DISABLE_ERROR_REPORTING=1 "$AGENT_BIN/claude" -p "$prompt") ;;
    codex)
      _agent_config_codex "$url" "$dir"
      cmd=("${AGENT_ENV[@]}" "CODEX_HOME=$dir/codex" "DS4_API_KEY=$key"
           "$AGENT_BIN/codex" exec --skip-git-repo-check "$prompt") ;;
    pi)
      _agent_config_pi "$url" "$dir"
      cmd=("${AGENT_ENV[@]}" PI_OFFLINE=1 "DS4_API_KEY=$key" "$AGENT_BIN/pi" --model ds4/ds4 -p "$prompt") ;;
    opencode)
      _agent_config_opencode "$url" "$dir"
      cmd=("${AGENT_ENV[@]}" "DS4_API_KEY=$key" OPENCODE_DISABLE_AUTOUPDATE=1 OPENCODE_DISABLE_MODELS_FETCH=1
           OPENCODE_DISABLE_LSP_DOWNLOAD=1 OPENCODE_DISABLE_SHARE=1 "$AGENT_BIN/opencode" run "$prompt") ;;
    *) echo "agent_run: unknown client '$client' (one of: ${AGENT_CLIENTS[*]})" >&2; return 2 ;;
  esac
  (cd "$dir/work" && timeout -k 10 "$secs" "${cmd[@]}" </dev/null >"$dir/out.txt" 2>"$dir/err.txt")
}
