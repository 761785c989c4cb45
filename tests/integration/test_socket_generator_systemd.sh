#!/usr/bin/env bash
# proxy.listen in ~/.config/ds4/ds4.yaml sets the port under systemd too:
# ds4-socket-generator, run by the user manager at daemon-reload, writes
# ds4-supervisor.socket's ListenStream= from it. On a fresh user manager
# (lib/systemd_env.sh), installed as the README says (`cmake --install build
# --prefix ~/.local`, the generator copied where the manager runs generators:
# here the harness's folder, standing in for
# /usr/local/lib/systemd/user-generators), checks:
#   - the generator alone: a valid config gives the drop-in, an absent one
#     nothing, an invalid one nothing and its problems on stderr, exit 0;
#   - the service serves on proxy.listen's port A;
#   - proxy.listen changed to port B, `systemctl --user daemon-reload`,
#     `systemctl --user stop ds4-supervisor.socket` and `systemctl --user
#     restart ds4-supervisor`: B serves, A is closed;
#   - an invalid config at a daemon-reload writes no drop-in and fails nothing.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/systemd_env.sh"
. "$here/lib/supervisor_env.sh"

[[ -x ${DS4_BIN:?DS4_BIN must name the bin folder of a build}/ds4-socket-generator ]] ||
  { echo "SKIP: no $DS4_BIN/ds4-socket-generator (build first)"; exit 77; }
sup_install_begin

# config PORT: the shipped config with model.path, proxy.listen on PORT and one thread.
config() {
  sed -e "s|^  path: \"\" |  path: \"$model\" |" -e "s|^  listen: 127.0.0.1:8080 |  listen: 127.0.0.1:$1 |" \
    -e "s|^  threads: 0 |  threads: 1 |" "$DS4_SRC/config/ds4.yaml" >"$HOME/.config/ds4/ds4.yaml"
  grep -q "listen: 127.0.0.1:$1 " "$HOME/.config/ds4/ds4.yaml" || fail "could not set proxy.listen in the shipped config"
}
dropin=ds4-supervisor.socket.d/10-proxy-listen.conf
generated=$XDG_RUNTIME_DIR/systemd/generator/$dropin
mkdir -p "$HOME/.config/ds4"
port_a=$(sup_free_port)
port_b=$(sup_free_port)
[[ $port_a != "$port_b" ]] || port_b=$((port_a + 1))

# The generator on its own, as systemd calls it.
out=$SUP_DIR/gen
mkdir -p "$out"
"$DS4_BIN/ds4-socket-generator" "$out" "$out" "$out" 2>"$SUP_DIR/gen.err"
[[ $? == 0 && ! -e $out/$dropin ]] && pass "no config: no drop-in (the socket unit's own address)" || fail "no config: $(ls -R "$out")"
config "$port_a"
"$DS4_BIN/ds4-socket-generator" "$out" "$out" "$out" 2>"$SUP_DIR/gen.err"
[[ $? == 0 && $(grep -v '^#' "$out/$dropin" 2>/dev/null) == $'[Socket]\nListenStream=\nListenStream=127.0.0.1:'"$port_a" ]] \
  && pass "a config: the drop-in resets ListenStream= to proxy.listen" || fail "drop-in: $(cat "$out/$dropin" 2>&1)"
rm -rf "${out:?}"/*
printf 'proxy:\n  listne: 127.0.0.1:9\n' >"$HOME/.config/ds4/ds4.yaml"
"$DS4_BIN/ds4-socket-generator" "$out" 2>"$SUP_DIR/gen.err"
rc=$?
[[ $rc == 0 && ! -e $out/$dropin ]] && grep -q "unknown key 'listne'" "$SUP_DIR/gen.err" \
  && pass "an invalid config: no drop-in, exit 0, the problem on stderr ($(tail -1 "$SUP_DIR/gen.err"))" \
  || fail "invalid config: rc $rc, stderr $(cat "$SUP_DIR/gen.err")"

# Installed as the README says.
if cmake --install "$build" --prefix "$HOME/.local" >"$SUP_DIR/install.log" 2>&1; then
  pass "cmake --install $build --prefix ~/.local"
else
  fail "cmake --install failed (build every target first):"; tail -n 5 "$SUP_DIR/install.log"; sup_finish
fi
gen=$HOME/.local/lib/systemd/user-generators/ds4-socket-generator
[[ -x $gen ]] && pass "the generator installed in ~/.local/lib/systemd/user-generators" || fail "not installed: $gen"
install -m 755 "$gen" "$DS4_SD_DIR/user-generators/"

config "$port_a"
systemctl --user daemon-reload
[[ $(systemctl --user show -P Listen ds4-supervisor.socket) == "127.0.0.1:$port_a (Stream)" ]] \
  && pass "daemon-reload: ds4-supervisor.socket listens on proxy.listen, 127.0.0.1:$port_a" \
  || fail "socket's Listen: $(systemctl --user show -P Listen ds4-supervisor.socket); generated: $(cat "$generated" 2>&1)"
if timeout 120 systemctl --user enable --now ds4-supervisor >"$SUP_DIR/enable.log" 2>&1; then
  pass "systemctl --user enable --now ds4-supervisor"
else
  fail "enable --now: $(cat "$SUP_DIR/enable.log")"
  journalctl --no-pager -q -n 30 --user-unit ds4-supervisor.service
  sup_finish
fi
sup_wait_health "http://127.0.0.1:$port_a" && pass "GET /health on port A ($port_a): 200" || fail "GET /health on $port_a: $code"

# The edit a user makes: proxy.listen to port B.
config "$port_b"
since=$(date '+%Y-%m-%d %H:%M:%S')
systemctl --user daemon-reload
if timeout 120 systemctl --user stop ds4-supervisor.socket >"$SUP_DIR/restart.log" 2>&1 &&
   timeout 120 systemctl --user restart ds4-supervisor >>"$SUP_DIR/restart.log" 2>&1; then
  pass "proxy.listen to $port_b, daemon-reload, stop ds4-supervisor.socket, restart ds4-supervisor"
else
  fail "restart: $(cat "$SUP_DIR/restart.log")"
fi
sup_wait_health "http://127.0.0.1:$port_b" && pass "GET /health on port B ($port_b): 200" || fail "GET /health on $port_b: $code"
code=$(sup_health "http://127.0.0.1:$port_a")
[[ $code == 000 ]] && pass "port A ($port_a) is closed" || fail "port A still answers: $code"
[[ $(sup_complete "http://127.0.0.1:$port_b" stories260K | tail -1) == 200 ]] && pass "a completion on port B" \
  || fail "a completion on port B"
log=$(journalctl --no-pager -q --since "$since" --user-unit ds4-supervisor.service -o cat)
if [[ $log != *"proxy listening on 127.0.0.1:$port_b "* ]]; then
  fail "the restarted supervisor's journal has no 'proxy listening on 127.0.0.1:$port_b'"
elif [[ $log == *"differs from the socket systemd holds"* ]]; then
  fail "the supervisor saw proxy.listen and the socket differ"
else
  pass "the restarted supervisor: 'proxy listening on 127.0.0.1:$port_b', no warning that proxy.listen differs"
fi

# An invalid config: the manager reloads, the generator writes nothing.
printf 'proxy:\n  listne: 127.0.0.1:9\n' >"$HOME/.config/ds4/ds4.yaml"
if timeout 30 systemctl --user daemon-reload; then
  [[ ! -e $generated ]] && pass "an invalid config at daemon-reload: no drop-in, the reload succeeds" \
    || fail "drop-in after an invalid config: $(cat "$generated")"
else
  fail "daemon-reload failed with an invalid config"
fi
state=$(systemctl --user is-system-running)
[[ $state == running || $state == degraded ]] && pass "the user manager still $state" || fail "user manager: $state"
[[ $(sup_health "http://127.0.0.1:$port_b") == 200 ]] && pass "the running service still serves on port B" || fail "port B after the reload"
sup_finish
