#!/usr/bin/env bash
# The shipped units (systemd/) install with cmake and run under a real user
# manager: the worker template reads its settings from the env file the
# supervisor writes, gets OOMScoreAdjust=1000 and Type=notify readiness; the
# supervisor unit reloads with SIGHUP. The daemons are stand-ins that record
# their arguments, so this tests the units, not ds4's binaries.
#
# Exit 0 = pass, 1 = fail, 77 = this machine cannot run it (reason printed).
set -u

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=${DS4_SRC:-$(cd "$here/../.." && pwd)}
. "$here/lib/systemd_env.sh"

fails=0
pass() { echo "ok   - $*"; }
fail() { echo "FAIL - $*"; fails=$((fails + 1)); }

command -v cmake >/dev/null || { echo "SKIP: no cmake"; exit 77; }
ds4_systemd_start || exit $?
trap ds4_systemd_stop EXIT

# Install only the units (a project of their own keeps this independent of
# the rest of the build).
proj=$DS4_SD_DIR/unitproj
mkdir -p "$proj"
cat >"$proj/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.25)
project(ds4units NONE)
add_subdirectory("$src/systemd" systemd)
EOF
if cmake -S "$proj" -B "$proj/build" >"$proj/log" 2>&1 && cmake --install "$proj/build" --prefix "$HOME/.local" >>"$proj/log" 2>&1; then
  pass "cmake --install puts the units in ~/.local/share/systemd/user"
else
  fail "installing the units"; cat "$proj/log"
fi

# Stand-in daemons: record argv, tell systemd READY=1 from the main process
# (NotifyAccess=main), then wait.
mkdir -p "$HOME/.local/bin"
for name in ds4-worker ds4-supervisor; do
  cat >"$HOME/.local/bin/$name" <<'EOF'
#!/usr/bin/python3
import os, signal, socket, sys, time
log = os.path.join(os.environ["XDG_RUNTIME_DIR"], os.path.basename(sys.argv[0]) + ".args")
with open(log, "w") as f: f.write(" ".join(sys.argv[1:]) + "\n")
def hup(*_):
    with open(log + ".hup", "a") as f: f.write("HUP\n")
signal.signal(signal.SIGHUP, hup)
addr = os.environ.get("NOTIFY_SOCKET", "")
if addr:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.connect("\0" + addr[1:] if addr.startswith("@") else addr)
    s.send(b"READY=1")
while True: time.sleep(1)
EOF
  chmod +x "$HOME/.local/bin/$name"
done
mkdir -p "$HOME/.config/ds4" "$XDG_RUNTIME_DIR/ds4"
cp "$src/config/ds4.yaml" "$HOME/.config/ds4/ds4.yaml"
systemctl --user daemon-reload

# --- worker template ---
cat >"$XDG_RUNTIME_DIR/ds4/worker-3.env" <<EOF
DS4_SEGMENT=ds4-model-abc
DS4_SOCKET=$XDG_RUNTIME_DIR/ds4/worker-3.sock
DS4_CONTEXT=4096
DS4_SLOTS=2
DS4_DEVICE=cpu
DS4_THREADS=0
EOF
if timeout 30 systemctl --user start ds4-worker@3.service; then
  pass "ds4-worker@3 reached $(systemctl --user is-active ds4-worker@3.service) (Type=notify)"
else
  fail "ds4-worker@3 did not start"; systemctl --user status ds4-worker@3.service --no-pager
fi
want="serve --id 3 --segment ds4-model-abc --socket $XDG_RUNTIME_DIR/ds4/worker-3.sock --context 4096 --slots 2 --device cpu --threads 0"
got=$(cat "$XDG_RUNTIME_DIR/ds4-worker.args" 2>/dev/null)
[[ $got == "$want" ]] && pass "worker command line from the env file: $got" || fail "worker args '$got', expected '$want'"
pid=$(systemctl --user show -P MainPID ds4-worker@3.service)
adj=$(cat "/proc/$pid/oom_score_adj" 2>/dev/null)
[[ $adj == 1000 ]] && pass "worker oom_score_adj = 1000" || fail "worker oom_score_adj = '$adj'"
[[ $(systemctl --user show -P Restart ds4-worker@3.service) == no ]] && pass "worker Restart=no" || fail "worker Restart is not no"
timeout 30 systemctl --user stop ds4-worker@3.service
[[ $(systemctl --user is-active ds4-worker@3.service) == inactive ]] && pass "worker stops" || fail "worker did not stop"

# Without its env file a worker does not start (the supervisor writes it first).
if timeout 30 systemctl --user start ds4-worker@4.service 2>/dev/null; then
  fail "ds4-worker@4 started without an env file"
else
  pass "ds4-worker@4 refuses to start without worker-4.env"
fi
systemctl --user reset-failed ds4-worker@4.service 2>/dev/null

# --- supervisor ---
if timeout 30 systemctl --user start ds4-supervisor.service; then
  pass "ds4-supervisor reached $(systemctl --user is-active ds4-supervisor.service)"
else
  fail "ds4-supervisor did not start"; systemctl --user status ds4-supervisor.service --no-pager
fi
got=$(cat "$XDG_RUNTIME_DIR/ds4-supervisor.args" 2>/dev/null)
[[ $got == "--config $HOME/.config/ds4/ds4.yaml" ]] && pass "supervisor args: $got" || fail "supervisor args '$got'"
timeout 30 systemctl --user reload ds4-supervisor.service
reloaded() { [[ -s $XDG_RUNTIME_DIR/ds4-supervisor.args.hup ]]; }
ds4_wait_until 10 reloaded && pass "reload sends SIGHUP" || fail "reload did not reach the supervisor"
for p in KillMode=process NotifyAccess=main Type=notify Restart=on-failure; do
  [[ $(systemctl --user show -p "${p%%=*}" ds4-supervisor.service) == "$p" ]] && pass "supervisor $p" || fail "supervisor ${p%%=*} is not ${p#*=}"
done
timeout 30 systemctl --user stop ds4-supervisor.service

if ((fails)); then echo "$fails failure(s)"; exit 1; fi
echo "all passed"
