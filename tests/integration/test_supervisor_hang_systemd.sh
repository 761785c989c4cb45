#!/usr/bin/env bash
# Hang detection, systemd backend, with the installed units: the build is
# installed with `cmake --install` into the test manager's ~/.local (a temp
# HOME), the installed ds4-supervisor runs ds4-worker@0.service from the
# installed template under a real user manager and journald
# (lib/systemd_env.sh). The worker is stopped with SIGSTOP: the supervisor
# logs DS4_EVENT=hang (also in the journal, with its figures), kills the unit
# through sd-bus KillUnit, restarts it at the same context, and the proxy
# serves again (lib/hang_check.sh).
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/systemd_env.sh"
. "$here/lib/supervisor_env.sh"
. "$here/lib/hang_check.sh"

model=${DS4_MODELS:-${DS4_SRC:-}/../shared/models}/stories260K.gguf
[[ -f $model ]] || { echo "SKIP: no $model"; exit 77; }
command -v curl >/dev/null || { echo "SKIP: no curl"; exit 77; }
command -v cmake >/dev/null || { echo "SKIP: no cmake"; exit 77; }
: "${DS4_BIN:?DS4_BIN must name the bin folder of a build}"
build=$(cd "$DS4_BIN/.." && pwd)
[[ -f $build/cmake_install.cmake ]] || { echo "SKIP: $build is not a CMake build folder"; exit 77; }
ds4_systemd_start || exit $?
SUP_PRIVATE_RUNTIME=0 sup_init || { ds4_systemd_stop; exit 77; }
cleanup() { sup_cleanup; ds4_systemd_stop; }
trap cleanup EXIT
unit=ds4-worker@0.service
cursor=$(journalctl --show-cursor -n 0 -q 2>/dev/null | sed -n 's/^-- cursor: //p')

# Install as a user would, into the manager's (temporary) ~/.local.
if cmake --install "$build" --prefix "$HOME/.local" >"$SUP_DIR/install.log" 2>&1; then
  pass "cmake --install $build --prefix \$HOME/.local"
else
  fail "cmake --install failed (build every target first):"; tail -n 5 "$SUP_DIR/install.log"; exit 1
fi
systemctl --user daemon-reload
DS4_BIN=$HOME/.local/bin

hang_write_config systemd "$model"
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; tail -n 30 "$SUP_DIR/sup.log"; exit 1; }
[[ $(sup_get 's["backend"]') == systemd ]] && pass "systemd backend" || fail "backend $(sup_get 's["backend"]')"
sup_wait 60 'w[0]["state"] == "ready"'
frag=$(systemctl --user show -P FragmentPath "$unit")
[[ $frag == "$HOME/.local/share/systemd/user/ds4-worker@.service" && ! -e $XDG_RUNTIME_DIR/systemd/user/ds4-worker@.service ]] \
  && pass "the installed unit runs: $frag" || fail "unit file in use: '$frag'"
[[ $(sup_get 'w[0]["binary"]') == "$HOME/.local/bin/ds4-worker" ]] && pass "the installed worker binary runs" \
  || fail "worker binary: $(sup_get 'w[0]["binary"]')"
hang_run
[[ $HANG_OLD_PID != "$(systemctl --user show -P MainPID $unit)" && $HANG_NEW_PID == "$(systemctl --user show -P MainPID $unit)" ]] \
  && pass "the unit's MainPID is the new process $HANG_NEW_PID" || fail "MainPID $(systemctl --user show -P MainPID $unit)"
entry=$(journalctl --cursor "$cursor" --no-pager -q DS4_EVENT=hang DS4_WORKER=0 -o export 2>/dev/null)
[[ $entry == *"DS4_HEARTBEAT_AGE_MS="* && $entry == *"DS4_HANG_TIMEOUT_MS=$HANG_TIMEOUT_MS"* && $entry == *"DS4_PID=$HANG_OLD_PID"* ]] \
  && pass "journal: DS4_EVENT=hang with its figures ($(echo "$entry" | grep -E '^DS4_(HEARTBEAT_AGE|UNANSWERED)_MS=' | tr '\n' ' '))" \
  || fail "no structured DS4_EVENT=hang entry in the journal"
grep -q "$unit ended: clean, killed by the supervisor (SIGKILL)" "$SUP_DIR/sup.log" \
  && pass "the unit's end is known as our own SIGKILL (KillUnit)" || fail "unit end not reported as our SIGKILL"
res=$(journalctl --cursor "$cursor" --no-pager -q --user-unit "$unit" -o cat 2>/dev/null | grep -m1 -i "killed\|signal")
[[ -n $res ]] && pass "user manager: ${res:0:120}" || echo "note - no manager message about the kill in the journal"

sup_stop
[[ $SUP_RC == 0 ]] && pass "SIGTERM: clean exit" || fail "supervisor exit status $SUP_RC"
[[ $(systemctl --user is-active $unit) == inactive ]] && pass "worker unit stopped" || fail "unit $(systemctl --user is-active $unit)"
sup_finish
