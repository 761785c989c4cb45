#!/usr/bin/env bash
# The README's quick start and Operations, in order, as a newcomer runs them
# on a fresh `git clone`. Every command run here is taken from README.md
# itself (readme_cmd: a code line of the section that matches a pattern),
# so a README that drifts from what works fails this test:
#   Quick start: scripts/run.sh (it serves ../shared/models/stories260K.gguf),
#     the chat completion with curl, build/bin/ds4ctl status, then Ctrl-C;
#   Operations, on a fresh user manager (lib/systemd_env.sh, a temp HOME):
#     cmake --install build --prefix ~/.local, the generator's sudo install,
#     the config copied (model.path set), daemon-reload, enable --now, the
#     health check, a change of proxy.listen (daemon-reload, the socket
#     stopped, the service restarted: the new port serves), systemctl --user
#     stop.
# Only `loginctl enable-linger` is not run (no logind here).
#
# The clone's build/ is the checkout's own build folder (a link), not a
# build from scratch: a first build of the service's programs takes about 6.5
# minutes on 2 idle cores, more than the 6 minutes this test may add to CI
# (90 in all), where the checkout is itself a fresh clone that scripts/test.sh
# has just built. run.sh then only checks that nothing is left to build. What
# a prebuilt tree would hide, a program the install copies that run.sh does
# not build, is checked from the build graph: every file `cmake --install`
# takes from build/ must be an input of ds4-programs, run.sh's target.
# DS4_README_FRESH_BUILD=1 builds in the clone instead (run by hand: past
# ctest's 600 s limit).
# When 127.0.0.1:8080 is taken, the README's 8080 is swapped for a free port
# (in the commands and in proxy.listen), and the test says so.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/systemd_env.sh"
. "$here/lib/supervisor_env.sh"

: "${DS4_SRC:?}" "${DS4_BIN:?}"
model=${DS4_MODELS:-$DS4_SRC/../shared/models}/stories260K.gguf
[[ -f $model ]] || { echo "SKIP: no $model"; exit 77; }
for c in curl cmake git ninja python3; do command -v $c >/dev/null || { echo "SKIP: no $c"; exit 77; }; done
((EUID == 0)) || { echo "SKIP: the user manager of the Operations part needs root (lib/systemd_env.sh)"; exit 77; }
build=$(cd "$DS4_BIN/.." && pwd)
[[ -f $build/build.ninja ]] || { echo "SKIP: $build is not a Ninja build folder"; exit 77; }
git -C "$DS4_SRC" rev-parse HEAD >/dev/null 2>&1 || { echo "SKIP: $DS4_SRC is not a git checkout"; exit 77; }

T=$(mktemp -d /tmp/ds4-readme-test.XXXXXX)
readme=$DS4_SRC/README.md
port_free() { python3 -c 'import socket,sys; s=socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1])))' "$1" 2>/dev/null; }
port=8080
if ! port_free 8080; then
  port=$(sup_free_port)
  echo "note: 127.0.0.1:8080 is taken here; the README's 8080 becomes $port"
fi

# readme_cmd SECTION REGEX: the one code line of README's "## SECTION" that
# matches REGEX (a line continued with '\' joined, a trailing '  # comment'
# cut), with 8080 swapped for $port; the same line twice counts once. Returns
# 1, saying so on stderr, when there is none or several.
readme_cmd() {
  local cmd
  cmd=$(python3 - "$readme" "$1" "$2" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r'^## ' + re.escape(sys.argv[2]) + r'[^\n]*\n(.*?)(?=^## |\Z)', text, re.S | re.M)
cmds, cur = [], None
for line in (m.group(1) if m else '').split('\n'):
    if not line.startswith('    '):
        continue
    part = line[4:] if cur is None else ' ' + line.strip()
    cur = (cur or '') + part
    if cur.endswith('\\'):
        cur = cur[:-1].rstrip()
        continue
    cmds.append(re.sub(r'\s{2,}#.*$', '', cur))
    cur = None
hits = sorted({c for c in cmds if re.search(sys.argv[3], c)})
if len(hits) != 1:
    sys.exit(1)
print(hits[0])
EOF
  ) || { echo "README.md, '## $1': no single command matching /$2/" >&2; return 1; }
  printf '%s\n' "${cmd//8080/$port}"
}
# run_readme SECTION REGEX [SED...]: runs that command in the clone (SED
# expressions adapt it to this machine) and passes when it exits 0.
run_readme() {
  local section=$1 re=$2 cmd sed_args=() e
  shift 2
  cmd=$(readme_cmd "$section" "$re") || { fail "README.md has no command /$re/"; return 1; }
  for e in "$@"; do sed_args+=(-e "$e"); done
  ((${#sed_args[@]})) && cmd=$(sed "${sed_args[@]}" <<<"$cmd")
  if (cd "$T/ds4" && bash -c "$cmd") >"$T/cmd.log" 2>&1; then
    pass "README: $cmd"
  else
    fail "README: $cmd: $(tail -n 5 "$T/cmd.log")"
    return 1
  fi
}

pid=
cleanup() {
  SUP_PID=$pid
  sup_stop   # TERM, at most 15 s, then KILL
  if [[ -n ${DS4_SD_DIR:-} ]]; then
    timeout 60 systemctl --user disable --now ds4-supervisor.service ds4-supervisor.socket >/dev/null 2>&1
    [[ -n ${SUP_DIR:-} ]] && sup_cleanup
    ds4_systemd_stop
  fi
  ((fails == 0)) && rm -rf "$T" || echo "kept $T"
}
trap cleanup EXIT

# A fresh clone beside ../shared/models, as a newcomer's checkout is.
git clone -q "$DS4_SRC" "$T/ds4" || { fail "git clone $DS4_SRC"; exit 1; }
mkdir -p "$T/shared"
ln -s "$(cd "$(dirname "$model")" && pwd)" "$T/shared/models"
if [[ ${DS4_README_FRESH_BUILD:-0} != 1 ]]; then
  ln -s "$build" "$T/ds4/build"
  # What the install copies from build/ must all be built by run.sh's target.
  programs=$(ninja -C "$build" -t query ds4-programs | sed -n 's|^    bin/|bin/|p')
  installed=$(grep -rhoE 'FILES "[^"]*"' --include=cmake_install.cmake "$build" | sed -E 's|^FILES "||; s|"$||; s|^.*/(bin/[^/]+)$|\1|' | sort -u)
  missing=$(comm -23 <(echo "$installed") <(echo "$programs" | sort -u))
  [[ -n $installed && -z $missing ]] && pass "every program cmake --install copies is built by ds4-programs ($(echo $installed))" \
    || fail "installed but not in ds4-programs (run.sh would not build them): ${missing:-no FILES found}"
fi

# Quick start. No user manager: the supervisor runs its workers as children.
export XDG_RUNTIME_DIR=$T/run
mkdir -p -m 0700 "$XDG_RUNTIME_DIR"
cmd=$(readme_cmd "Quick start" '^scripts/run\.sh$') || { fail "README.md has no scripts/run.sh"; exit 1; }
if [[ $port == 8080 ]]; then
  (cd "$T/ds4" && exec $cmd) >"$T/run.log" 2>&1 &
else
  printf 'model:\n  path: %s\n  name: stories\nproxy:\n  listen: 127.0.0.1:%s\n' "$model" "$port" >"$T/run.yaml"
  (cd "$T/ds4" && exec $cmd "$T/run.yaml") >"$T/run.log" 2>&1 &
  cmd+=" $T/run.yaml"
fi
pid=$!
start=$SECONDS
limit=60
[[ ${DS4_README_FRESH_BUILD:-0} == 1 ]] && limit=900
url=
while ((SECONDS - start < limit)); do
  url=$(sed -n 's/.*proxy listening on [^ ]* (OpenAI and Anthropic APIs at \(http:[^ ]*\)\/v1.*/\1/p' "$T/run.log" | head -1)
  [[ -n $url ]] && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.2
done
if [[ $url == "http://127.0.0.1:$port" ]]; then
  pass "README: $cmd: 'proxy listening on 127.0.0.1:$port' after $((SECONDS - start)) s"
else
  fail "README: $cmd printed no 'proxy listening on 127.0.0.1:$port' in $limit s; its log:"
  tail -n 20 "$T/run.log"
  exit 1
fi
grep -q "stories260K.gguf" "$T/run.log" && pass "it serves ../shared/models/stories260K.gguf" || fail "not the stories model"
sup_wait_health "$url"
[[ $code == 200 ]] || fail "GET /health: $code"
cmd=$(readme_cmd "Quick start" '^curl .*/v1/chat/completions') || cmd=false
reply=$(cd "$T/ds4" && bash -c "$cmd" 2>&1)
[[ ${reply:-} == *'"choices"'* ]] && pass "README: ${cmd:0:60}...: a completion" || fail "README chat completion: ${reply:0:300}"
cmd=$(readme_cmd "Quick start" '^build/bin/ds4ctl status$') || cmd=false
status=$(cd "$T/ds4" && $cmd 2>&1)
[[ ${status:-} == *worker* ]] && pass "README: $cmd: $(grep -m1 -i worker <<<"$status")" || fail "ds4ctl status: ${status:-}"
kill -INT "$pid"   # Ctrl-C in run.sh's terminal
for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
wait "$pid"
rc=$?
pid=
[[ $rc == 0 ]] && pass "Ctrl-C: run.sh's supervisor drained and exited 0" || fail "Ctrl-C: exit $rc"
((fails)) && { echo "$fails failure(s)"; exit 1; }

# Operations, on a user manager of its own (a temp HOME: ~ is there).
unset XDG_RUNTIME_DIR
ds4_systemd_start || { echo "SKIP: the Operations part (no user manager here)"; exit 77; }
SUP_PRIVATE_RUNTIME=0 sup_init || exit 77
run_readme Operations '^cmake --install build --prefix ~/\.local$'
# The generator goes where the user manager runs generators: for this
# manager its own folder, not the machine's /usr/local/lib (root here: no sudo).
run_readme Operations '^sudo install .*ds4-socket-generator$' 's|^sudo ||' "s|/usr/local/lib/systemd/user-generators|$DS4_SD_DIR/user-generators|"
run_readme Operations '^mkdir -p ~/\.config/ds4 && cp config/ds4\.yaml ~/\.config/ds4/$'
# "set model.path" (and one thread: tests run side by side).
sed -i -e "s|^  path: \"\" |  path: \"$model\" |" -e "s|^  listen: 127.0.0.1:8080 |  listen: 127.0.0.1:$port |" \
  -e "s|^  threads: 0 |  threads: 1 |" "$HOME/.config/ds4/ds4.yaml"
grep -q "path: \"$model\"" "$HOME/.config/ds4/ds4.yaml" || fail "could not set model.path in the shipped config"
run_readme Operations '^systemctl --user daemon-reload$'
run_readme Operations '^systemctl --user enable --now ds4-supervisor$' || journalctl --no-pager -q -n 30 --user-unit ds4-supervisor.service
cmd=$(readme_cmd Operations '^curl -s localhost:[0-9]+/health$') || cmd=false
code=
for _ in $(seq 300); do
  code=$(cd "$T/ds4" && bash -c "$cmd -o /dev/null -w '%{http_code}'")
  [[ $code == 200 ]] && break
  sleep 0.1
done
[[ $code == 200 ]] && pass "README: $cmd: 200" || fail "README: $cmd: $code"

# A change of proxy.listen, applied as the README says.
new_port=$(sup_free_port)
sed -i "s|^  listen: 127.0.0.1:$port |  listen: 127.0.0.1:$new_port |" "$HOME/.config/ds4/ds4.yaml"
grep -q "listen: 127.0.0.1:$new_port " "$HOME/.config/ds4/ds4.yaml" || fail "could not change proxy.listen"
run_readme Operations '^systemctl --user daemon-reload$'
run_readme Operations '^systemctl --user stop ds4-supervisor\.socket$'
run_readme Operations '^systemctl --user restart ds4-supervisor$'
sup_wait_health "http://127.0.0.1:$new_port"
[[ $code == 200 ]] && pass "proxy.listen changed to $new_port: it serves there" || fail "GET /health on $new_port: $code"
code=$(sup_health "http://127.0.0.1:$port")
[[ $code == 000 ]] && pass "and no longer on $port" || fail "the old port $port answers: $code"

# The stop the README names.
stop='systemctl --user stop ds4-supervisor'
grep -qF "\`$stop\`" "$readme" || fail "README.md no longer names \`$stop\`"
if timeout 90 bash -c "$stop"; then
  state=$(systemctl --user is-active ds4-supervisor)
  [[ $state == inactive ]] && pass "README: $stop: $state" || fail "after $stop: $state"
else
  fail "README: $stop failed"
fi
# "The port stays open, and the next connection to it starts the supervisor again".
sup_wait_health "http://127.0.0.1:$new_port" 300 60
state=$(systemctl --user is-active ds4-supervisor)
[[ $code == 200 && $state == active ]] && pass "a connection after the stop starts it again: /health $code, $state" \
  || fail "a connection after the stop: /health $code, the service $state"
stop='systemctl --user stop ds4-supervisor.socket ds4-supervisor'
grep -qF "\`$stop\`" <(tr '\n' ' ' <"$readme") || fail "README.md no longer names \`$stop\`"
if timeout 90 bash -c "$stop"; then
  code=$(sup_health "http://127.0.0.1:$new_port")
  state="$(systemctl --user is-active ds4-supervisor.socket) $(systemctl --user is-active ds4-supervisor)"
  [[ $code == 000 && $state == "inactive inactive" ]] && pass "README: $stop: both $state, the port closed" \
    || fail "after $stop: $state, /health $code"
else
  fail "README: $stop failed"
fi
sup_finish
