#!/usr/bin/env bash
# The install path of the README, on a fresh user manager (lib/systemd_env.sh:
# real journald and `systemd --user`, a temp HOME): `cmake --install build
# --prefix ~/.local`, a config at ~/.config/ds4/ds4.yaml, `systemctl --user
# daemon-reload` and `enable --now ds4-supervisor`. Then the service serves
# (/health, /status, a completion) on the socket unit's port, from the
# installed binaries and worker template, and the installed ds4ctl finds it.
# Last, what the README says about signals: a plain `kill -TERM` of the
# supervisor is a stop (exit 0, the unit inactive, not restarted), while a
# `kill -KILL` is a crash that systemd restarts.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/systemd_env.sh"
. "$here/lib/supervisor_env.sh"

sup_install_begin

if cmake --install "$build" --prefix "$HOME/.local" >"$SUP_DIR/install.log" 2>&1; then
  pass "cmake --install $build --prefix ~/.local"
else
  fail "cmake --install failed (build every target first):"; tail -n 5 "$SUP_DIR/install.log"; sup_finish
fi
for f in bin/ds4-supervisor bin/ds4-worker bin/ds4ctl share/systemd/user/ds4-supervisor.service \
         share/systemd/user/ds4-supervisor.socket share/systemd/user/ds4-worker@.service; do
  [[ -e $HOME/.local/$f ]] || fail "not installed: ~/.local/$f"
done
pass "binaries in ~/.local/bin, units in ~/.local/share/systemd/user"

# The config as the README says: the shipped file, model.path set. The port
# is the socket unit's (a drop-in, as its comment says), on a free port.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p "$HOME/.config/ds4" "$HOME/.config/systemd/user/ds4-supervisor.socket.d"
printf '[Socket]\nListenStream=\nListenStream=127.0.0.1:%s\n' "$port" \
  >"$HOME/.config/systemd/user/ds4-supervisor.socket.d/50-port.conf"
sed -e "s|^  path: \"\" |  path: \"$model\" |" -e "s|^  listen: 127.0.0.1:8080 |  listen: 127.0.0.1:$port |" \
  -e "s|^  threads: 0 |  threads: 1 |" "$DS4_SRC/config/ds4.yaml" >"$HOME/.config/ds4/ds4.yaml"
grep -q "path: \"$model\"" "$HOME/.config/ds4/ds4.yaml" || fail "could not set model.path in the shipped config"
systemctl --user daemon-reload
if timeout 120 systemctl --user enable --now ds4-supervisor >"$SUP_DIR/enable.log" 2>&1; then
  pass "systemctl --user enable --now ds4-supervisor"
else
  fail "enable --now: $(cat "$SUP_DIR/enable.log")"
  journalctl --no-pager -q -n 30 --user-unit ds4-supervisor.service
  sup_finish
fi
[[ $(systemctl --user is-enabled ds4-supervisor) == enabled ]] && pass "enabled (at every start of the manager)" \
  || fail "is-enabled: $(systemctl --user is-enabled ds4-supervisor)"
url=http://127.0.0.1:$port
sup_wait_health "$url" && pass "GET /health: 200 on the socket unit's port $port" || fail "GET /health: $code"
[[ $(curl -s -o /dev/null -w '%{http_code}' "$url/status") == 200 ]] && pass "GET /status: the page" || fail "GET /status"
[[ $(sup_complete "$url" stories260K | tail -1) == 200 ]] && pass "a completion" || fail "a completion"
DS4_BIN=$HOME/.local/bin
[[ $(sup_get 's["backend"]') == systemd ]] && pass "the installed ds4ctl finds it; workers as systemd units" \
  || fail "ds4ctl status: backend $(sup_get 's["backend"]')"
frag=$(systemctl --user show -P FragmentPath ds4-worker@0.service)
[[ $frag == "$HOME/.local/share/systemd/user/ds4-worker@.service" ]] && pass "the installed worker template runs" \
  || fail "worker unit file: '$frag'"
[[ $(sup_get 'w[0]["binary"]') == "$HOME/.local/bin/ds4-worker" ]] && pass "the installed worker binary runs" \
  || fail "worker binary: $(sup_get 'w[0]["binary"]')"

# kill -KILL: a crash, restarted (Restart=on-failure).
main=$(systemctl --user show -P MainPID ds4-supervisor)
kill -KILL "$main"
ds4_wait_until 30 bash -c '[[ $(systemctl --user show -P NRestarts ds4-supervisor) == 1 &&
                              $(systemctl --user is-active ds4-supervisor) == active ]]' \
  && pass "kill -KILL: systemd restarted it (NRestarts 1, pid $main -> $(systemctl --user show -P MainPID ds4-supervisor))" \
  || fail "kill -KILL: $(systemctl --user is-active ds4-supervisor), NRestarts $(systemctl --user show -P NRestarts ds4-supervisor)"
sup_wait 60 'w[0]["state"] == "ready"' || fail "not ready again after the crash"

# kill -TERM: a stop. The supervisor drains, exits 0; systemd leaves it stopped.
main=$(systemctl --user show -P MainPID ds4-supervisor)
kill -TERM "$main"
ds4_wait_until 60 bash -c '[[ $(systemctl --user is-active ds4-supervisor) != active && $(systemctl --user is-active ds4-supervisor) != deactivating ]]'
sleep 2  # RestartSec is 200ms: a restart would have come by now
state=$(systemctl --user is-active ds4-supervisor)
result=$(systemctl --user show -P Result ds4-supervisor)
restarts=$(systemctl --user show -P NRestarts ds4-supervisor)
[[ $state == inactive && $result == success && $restarts == 1 ]] \
  && pass "kill -TERM: a stop: inactive, result $result, not restarted (NRestarts still $restarts)" \
  || fail "kill -TERM: state $state, result $result, NRestarts $restarts"
[[ $(systemctl --user is-active ds4-worker@0.service) != active ]] && pass "its worker unit stopped with it" \
  || fail "worker unit still $(systemctl --user is-active ds4-worker@0.service)"
sup_finish
