#!/usr/bin/env bash
# A fresh machine: `ds4-supervisor --config config/ds4.yaml` with the shipped
# config (no model configured) and no systemd user manager makes a synthetic
# model (saying loudly that its weights are random), runs the worker as a
# child process, and answers `ds4ctl status`; the admin socket is the
# owner's only; a second supervisor on the same runtime folder is refused; a
# model.path that names no file is an error, not random weights.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"

sup_init || exit $?
trap sup_cleanup EXIT
# No user bus: the automatic backend must fall back to child processes.
unset DBUS_SESSION_BUS_ADDRESS
# The shipped file as it is, from a copy of the source layout (relative paths
# in it resolve against its folder).
mkdir -p "$SUP_DIR/src/config"
cp "$DS4_SRC/config/ds4.yaml" "$SUP_DIR/src/config/ds4.yaml"
# Another test may hold the shipped default port; this one does not need it.
sed -i 's/^  listen: 127.0.0.1:8080 /  listen: 127.0.0.1:0    /' "$SUP_DIR/src/config/ds4.yaml"
cd "$SUP_DIR/src" || exit 1
sup_start config/ds4.yaml || { fail "supervisor did not start"; tail -n 30 "$SUP_DIR/sup.log"; exit 1; }
if sup_wait 60 'w[0]["state"] == "ready"'; then pass "worker ready: $(sup_get 'w[0]["unit"]') pid $(sup_get 'w[0]["pid"]') context $(sup_get 'w[0]["context"]')"
else fail "no ready worker: $(sup_status | tr -d '\n' | cut -c1-400)"; fi
[[ $(sup_get 's["backend"]') == process ]] && pass "no user manager: child processes" || fail "backend $(sup_get 's["backend"]')"
[[ $(sup_get 's["model"]["synthetic"]') == True ]] && pass "synthetic model: $(sup_get 's["model"]["path"]')" || fail "model not marked synthetic"
grep -q 'RANDOM WEIGHTS' "$SUP_DIR/sup.log" && pass "says loudly that the weights are random" || fail "no RANDOM WEIGHTS warning"
sock=$XDG_RUNTIME_DIR/ds4/admin.sock
[[ $(stat -c %a "$sock") == 600 && $(stat -c %a "$XDG_RUNTIME_DIR/ds4") == 700 ]] \
  && pass "admin socket 0600 in a 0700 folder" || fail "modes: socket $(stat -c %a "$sock"), dir $(stat -c %a "$XDG_RUNTIME_DIR/ds4")"
"$DS4_BIN/ds4ctl" status | grep -q 'RANDOM WEIGHTS' && pass "ds4ctl status shows the synthetic model" || fail "ds4ctl status"
# How much of the segment is in 2 MiB pages: a figure no larger than the segment, on its own line.
pages=$(sup_get 's["model"]["huge_page_bytes"] <= s["model"]["bytes"]')
[[ $pages == True ]] && "$DS4_BIN/ds4ctl" status | grep -q '^pages .* of the segment in 2 MiB pages' \
  && pass "status: $(sup_get 's["model"]["huge_page_bytes"]') of $(sup_get 's["model"]["bytes"]') bytes in 2 MiB pages" \
  || fail "status: huge_page_bytes '$pages'; $("$DS4_BIN/ds4ctl" status | grep '^pages')"
# A second supervisor on the same runtime folder stops before touching the
# first one's sockets (it used to take them over, then remove them on exit).
out=$(timeout 30 "$DS4_BIN/ds4-supervisor" --config config/ds4.yaml 2>&1); rc=$?
[[ $rc == 1 && $out == *"another ds4-supervisor (pid $SUP_PID) runs on $XDG_RUNTIME_DIR/ds4"* ]] \
  && pass "a second supervisor on this runtime folder: exit 1 naming the first" || fail "second supervisor: exit $rc: $out"
[[ -S $sock ]] && "$DS4_BIN/ds4ctl" status >/dev/null && pass "the first still answers on its admin socket" \
  || fail "the first supervisor lost its admin socket"
# Worker ids past 2^31 are refused, by ds4ctl and by the admin socket (as an
# int, 4294967296 was worker 0: it drained it).
out=$("$DS4_BIN/ds4ctl" drain 4294967296 2>&1); rc=$?
raw=$(python3 -c '
import json, socket, sys
s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sys.argv[1])
s.sendall(b"{\"cmd\":\"drain\",\"worker\":4294967296}\n"); print(s.makefile().readline().strip())' "$sock" 2>&1)
[[ $rc != 0 && $out == *"expected a worker id"* && $raw == *'"ok":false'* && $raw == *"no worker 4294967296"* ]] \
  && sup_wait 5 'w[0]["state"] == "ready"' && pass "worker id 2^32: refused by ds4ctl and the supervisor, worker 0 still ready" \
  || fail "worker id 2^32: ds4ctl exit $rc: $out; admin: $raw; worker 0 $(sup_get 'w[0]["state"]')"
out=$("$DS4_BIN/ds4ctl" status extra 2>&1); rc=$?
[[ $rc == 1 && $out == "ds4ctl: 'status' takes only --json, not 'extra'"$'\n'"usage: ds4ctl"* ]] \
  && pass "ds4ctl names a stray argument, with the usage once" || fail "ds4ctl status extra: exit $rc: $out"
# The worker serves the token protocol on its socket.
wsock=$(sup_get 'w[0]["socket"]')
info=$(python3 -c '
import socket, sys
s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sys.argv[1])
s.sendall(b"{\"op\":\"info\"}\n"); print(s.makefile().readline().strip())' "$wsock" 2>&1)
[[ $info == *'"ev":"info"'* ]] && pass "the worker answers on $wsock" || fail "worker info: $info"
# workers.busy_poll: auto (the shipped value): the worker polls 100 us before
# it sleeps on a machine of 8 or more cores, not on a smaller one.
want=$(( $(getconf _NPROCESSORS_ONLN) >= 8 ? 100 : 0 ))
args=$(tr '\0' ' ' <"/proc/$(sup_get 'w[0]["pid"]')/cmdline" 2>/dev/null)
[[ $args == *"--busy-poll-us $want "* ]] && pass "workers.busy_poll auto: the worker polls ${want} us" \
  || fail "workers.busy_poll auto: expected --busy-poll-us $want in: $args"
segment=$(sup_get 's["model"]["segment"]')
sup_stop
[[ $SUP_RC == 0 ]] && pass "SIGTERM: clean exit" || fail "supervisor exit status $SUP_RC"
# The synthetic model lives in this test's folder: its segment goes with it.
[[ -n $segment ]] && "$DS4_BIN/ds4-worker" unload --segment "$segment" >/dev/null
[[ ! -e $sock ]] && pass "admin socket removed on exit" || fail "admin socket left behind"
# `unload` removes model segments only, not whatever else lives in /dev/shm.
other=/dev/shm/ds4test-notours-$$
echo keep >"$other"
out=$("$DS4_BIN/ds4-worker" unload --segment "${other#/dev/shm/}" 2>&1); rc=$?
[[ $rc != 0 && -f $other && $out == *"is not a model segment's name"* ]] && pass "unload refuses a name that is not a model segment's" \
  || fail "unload of another program's shared memory: exit $rc, $out"
rm -f "$other"
# A model.path that names no file is an error where it is written, not a
# model with random weights served in its place.
printf 'model:\n  path: %s\n' "$SUP_DIR/no-such-model.gguf" >"$SUP_DIR/typo.yaml"
out=$(timeout 30 "$DS4_BIN/ds4-supervisor" --config "$SUP_DIR/typo.yaml" 2>&1); rc=$?
[[ $rc == 1 && $out == *"typo.yaml:2:9: model.path: $SUP_DIR/no-such-model.gguf: no such file"* && $out != *"RANDOM WEIGHTS"* ]] \
  && pass "a model.path that names no file: exit 1 with file:line:column" || fail "a missing model file: exit $rc: $out"
# A model no worker can run (another architecture) is refused before it is
# copied into shared memory, naming the file (it was loaded whole, then
# refused by the worker naming the segment, and the segment stayed).
python3 - "$DS4_MODELS/stories260K.gguf" "$SUP_DIR/gpt2x.gguf" <<'PY'
import sys
data = bytearray(open(sys.argv[1], "rb").read())
key = b"general.architecture"
at = data.index(key) + len(key) + 4 + 8  # the value: type (u32), length (u64), then the text
assert data[at:at + 5] == b"llama"
data[at:at + 5] = b"gpt2x"
open(sys.argv[2], "wb").write(data)
PY
before_shm=$(ls /dev/shm | grep -c '^ds4-model-')
printf 'model:\n  path: %s\nproxy:\n  listen: 127.0.0.1:0\n' "$SUP_DIR/gpt2x.gguf" >"$SUP_DIR/gpt2x.yaml"
out=$(timeout 30 "$DS4_BIN/ds4-supervisor" --config "$SUP_DIR/gpt2x.yaml" 2>&1); rc=$?
load_out=$(timeout 30 "$DS4_BIN/ds4-worker" load --model "$SUP_DIR/gpt2x.gguf" 2>&1); load_rc=$?
[[ $rc == 1 && $out == *"$SUP_DIR/gpt2x.gguf: general.architecture is 'gpt2x'"* && $load_rc == 1 &&
   $load_out == *"$SUP_DIR/gpt2x.gguf: general.architecture is 'gpt2x'"* && $(ls /dev/shm | grep -c '^ds4-model-') == "$before_shm" ]] \
  && pass "a model of another architecture: refused naming the file, nothing left in /dev/shm" \
  || fail "another architecture: supervisor exit $rc: $out; load exit $load_rc: $load_out; segments $before_shm -> $(ls /dev/shm | grep -c '^ds4-model-')"
# workers.device cuda on a build without the CUDA backend: said at once (its
# holder and workers crash-looped, saying only "exited with status 1").
if "$DS4_BIN/ds4-worker" hold 2>&1 | grep -q "built without the CUDA backend"; then
  printf 'model:\n  path: %s\nproxy:\n  listen: 127.0.0.1:0\nworkers:\n  device: cuda:0\n' "$DS4_MODELS/stories260K.gguf" >"$SUP_DIR/cuda.yaml"
  out=$(timeout 30 "$DS4_BIN/ds4-supervisor" --config "$SUP_DIR/cuda.yaml" 2>&1); rc=$?
  [[ $rc == 1 && $out == *"workers.device cuda:0: this build has no CUDA backend"* && $out != *"in segment"* ]] \
    && pass "device cuda:0 on a CPU build: exit 1 before the model loads" || fail "device cuda on a CPU build: exit $rc: $out"
else
  echo "skip - device cuda on a CPU build: this is a CUDA build"
fi
# A --config that names no file is an error; only the default path may be
# missing (then the embedded defaults run).
out=$(timeout 30 "$DS4_BIN/ds4-supervisor" --config "$SUP_DIR/no-such.yaml" 2>&1); rc=$?
[[ $rc == 1 && $out == *"$SUP_DIR/no-such.yaml: no such config file"* && $out != *"RANDOM WEIGHTS"* ]] \
  && pass "a --config that names no file: exit 1" || fail "a missing --config file: exit $rc: $out"
# A port another process listens on, or an api keys file that is a folder:
# said before the model loads (a large model's load took minutes to end so).
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
python3 -c 'import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
time.sleep(30)' "$port" &
holder=$!
sleep 0.5
printf 'model:\n  path: %s\nproxy:\n  listen: 127.0.0.1:%s\n' "$DS4_MODELS/stories260K.gguf" "$port" >"$SUP_DIR/busy.yaml"
out=$(timeout 30 "$DS4_BIN/ds4-supervisor" --config "$SUP_DIR/busy.yaml" 2>&1); rc=$?
kill $holder 2>/dev/null; wait $holder 2>/dev/null
[[ $rc == 1 && $out == *"proxy.listen 127.0.0.1:$port: cannot listen: Address already in use"* && $out != *"in segment"* ]] \
  && pass "a port in use: exit 1 before the model loads" || fail "a port in use: exit $rc: $out"
mkdir -p "$SUP_DIR/keys-folder"
printf 'model:\n  path: %s\nproxy:\n  listen: 127.0.0.1:0\n  api_keys_file: %s\n' "$DS4_MODELS/stories260K.gguf" "$SUP_DIR/keys-folder" >"$SUP_DIR/keys.yaml"
out=$(timeout 30 "$DS4_BIN/ds4-supervisor" --config "$SUP_DIR/keys.yaml" 2>&1); rc=$?
[[ $rc == 1 && $out == *"keys.yaml:5:18: proxy.api_keys_file: '$SUP_DIR/keys-folder' is a folder, not a file of keys"* && $out != *"in segment"* ]] \
  && pass "an api keys file that is a folder: exit 1 where it is written, before the model loads" || fail "keys folder: exit $rc: $out"
sup_finish 30
