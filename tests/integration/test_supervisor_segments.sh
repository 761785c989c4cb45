#!/usr/bin/env bash
# Old model segments go away (DESIGN.md, Shared memory): when the GGUF file
# changed (new mtime: at the next start, or at a reload of the same config)
# or model.path changed (SIGHUP),
# the old segment is removed from /dev/shm once no process maps it, with one
# log entry each; a segment some process still maps (a stand-in for an old
# worker, or an unrelated ds4-model-* file another process maps) stays, and so
# does one this instance never served (another instance's), mapped or not.
# Process backend, on copies of stories260K.gguf.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"

model=${DS4_MODELS:-$DS4_SRC/../shared/models}/stories260K.gguf
[[ -f $model ]] || { echo "SKIP: no $model"; exit 77; }
[[ -d /dev/shm && -w /dev/shm ]] || { echo "SKIP: no writable /dev/shm"; exit 77; }
sup_init || exit $?
unset DBUS_SESSION_BUS_ADDRESS

fake_mapped=ds4-model-test-$$-mapped  # mapped by an unrelated process all along
fake_stale=ds4-model-test-$$-stale    # mapped by nobody
holders=()
segments=()
cleanup() {
  local p s
  for p in "${holders[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  sup_cleanup
  for s in "$fake_mapped" "$fake_stale" "${segments[@]}"; do [[ -n $s ]] && rm -f "/dev/shm/$s"; done
}
trap cleanup EXIT

cp "$model" "$SUP_DIR/a.gguf"
cp "$model" "$SUP_DIR/b.gguf"
write_config() {
  cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $1
  name: stories
proxy:
  listen: 127.0.0.1:0         # any free port: tests run side by side
workers:
  backend: process
  device: cpu
  threads: 1
  context:
    ladder: [256]
headroom:
  min_available: 16MiB
YAML
}

# hold_map FILE: a process that maps FILE read-only until killed (at most
# 300 s); its pid goes into $holder and onto the cleanup list.
hold_map() {
  python3 -c '
import mmap, sys, time
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print("mapped", flush=True)
time.sleep(300)' "$1" >"$SUP_DIR/holder.$$.out" 2>&1 &
  holder=$!
  holders+=("$holder")
  local i
  for i in $(seq 100); do grep -q mapped "$SUP_DIR/holder.$$.out" 2>/dev/null && return 0; sleep 0.1; done
  sup_log "could not map $1: $(cat "$SUP_DIR/holder.$$.out")"
  return 1
}

# wait_gone NAME SECONDS: true once /dev/shm/NAME is gone.
wait_gone() {
  local i
  for i in $(seq $(($2 * 10))); do [[ -e /dev/shm/$1 ]] || return 0; sleep 0.1; done
  return 1
}

# older_than NAME SECONDS: waits until /dev/shm/NAME changed at least that
# long ago (a sweep spares younger segments: a loader may be creating them).
older_than() {
  local changed
  changed=$(stat -c %Z "/dev/shm/$1") || return 1
  while (($(date +%s) < changed + $2)); do sleep 0.2; done
}

# --- setup: two unrelated ds4-model-* files, one of them mapped -----------
head -c 4096 /dev/zero >"/dev/shm/$fake_mapped"
head -c 4096 /dev/zero >"/dev/shm/$fake_stale"
hold_map "/dev/shm/$fake_mapped" || { fail "python3 could not map $fake_mapped"; sup_finish; }

# --- 1. the file changed while the supervisor was stopped -----------------
write_config "$SUP_DIR/a.gguf"
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; sup_finish; }
sup_wait 60 'w[0]["state"] == "ready"' || fail "no ready worker: $(sup_status | tr -d '\n' | cut -c1-300)"
s1=$(sup_get 's["model"]["segment"]')
segments+=("$s1")
sup_stop
[[ -e /dev/shm/$s1 ]] && pass "stopped: segment $s1 stays for the next start" || fail "$s1 gone after a stop"

older_than "$s1" 6
older_than "$fake_stale" 6
touch "$SUP_DIR/a.gguf"
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not restart"; sup_finish; }
sup_wait 60 'w[0]["state"] == "ready"' || fail "no ready worker after the restart"
s2=$(sup_get 's["model"]["segment"]')
segments+=("$s2")
[[ -n $s2 && $s2 != "$s1" ]] && pass "new mtime: new segment $s2" || fail "segment after touch: '$s2' (was $s1)"
wait_gone "$s1" 10 && pass "the old segment $s1 was removed at start" || fail "$s1 still in /dev/shm"
grep -Eq "removed old model segment $s1 \(1\.2 MiB freed\): no process maps it \(.*DS4_SEGMENT=$s1, DS4_BYTES_FREED=[0-9]+" "$SUP_DIR/sup.log" \
  && pass "logged: $(grep -m1 "removed old model segment $s1" "$SUP_DIR/sup.log" | cut -c1-200)" \
  || fail "no 'removed old model segment $s1' line with DS4_SEGMENT and DS4_BYTES_FREED"
# Not this instance's (its runtime folder never served it): another instance's
# or another user's segment, which a start must never remove, mapped or not.
[[ -e /dev/shm/$fake_stale ]] && pass "an unmapped $fake_stale that this instance never served is kept" \
  || fail "$fake_stale (never served by this instance) was removed"
grep -qx "$s2" "$XDG_RUNTIME_DIR/ds4/segments.list" && ! grep -qx "$s1" "$XDG_RUNTIME_DIR/ds4/segments.list" \
  && pass "segments.list lists the served $s2 and no longer the removed $s1" \
  || fail "segments.list: $(tr '\n' ' ' <"$XDG_RUNTIME_DIR/ds4/segments.list" 2>&1)"
[[ -e /dev/shm/$fake_mapped ]] && pass "$fake_mapped, mapped by pid ${holders[0]}, is kept" || fail "$fake_mapped was removed while mapped"
[[ -e /dev/shm/$s2 ]] && pass "the served segment $s2 is there" || fail "$s2 missing"

# --- 2. model.path changed, SIGHUP, while an 'old worker' still maps it ----
hold_map "/dev/shm/$s2" || fail "python3 could not map $s2"
old_holder=$holder
older_than "$s2" 6
pid=$(sup_get 'w[0]["pid"]')
write_config "$SUP_DIR/b.gguf"
kill -HUP "$SUP_PID"
if sup_wait 60 's["model"]["segment"] != "'"$s2"'" and w[0]["state"] == "ready" and w[0]["pid"] != '"$pid"; then
  s3=$(sup_get 's["model"]["segment"]')
  segments+=("$s3")
  pass "reload: new model.path served from $s3, worker $(sup_get 'w[0]["pid"]') replaced $pid"
else
  fail "reload not applied: $(sup_status | tr -d '\n' | cut -c1-300)"
fi
sleep 3  # the old worker's exit has been swept by now (sweeps are 2 s apart at most)
[[ -e /dev/shm/$s2 ]] && pass "$s2 kept while another process maps it" || fail "$s2 removed while mapped"
kill "$old_holder"; wait "$old_holder" 2>/dev/null
pid=$(sup_get 'w[0]["pid"]')
"$DS4_BIN/ds4ctl" restart 0 >/dev/null || fail "ds4ctl restart 0"
sup_wait 30 'w[0]["state"] == "ready" and w[0]["pid"] != '"$pid" || fail "worker not restarted"
wait_gone "$s2" 10 && pass "once unmapped, $s2 was removed (after a worker exit)" || fail "$s2 still in /dev/shm"
grep -Eq "removed old model segment $s2 \(1\.2 MiB freed\): no process maps it \(.*DS4_SEGMENT=$s2, DS4_BYTES_FREED=[0-9]+" "$SUP_DIR/sup.log" \
  && pass "logged: $(grep -m1 "removed old model segment $s2" "$SUP_DIR/sup.log" | cut -c1-200)" \
  || fail "no 'removed old model segment $s2' line"
[[ -e /dev/shm/$fake_mapped ]] && pass "$fake_mapped still kept" || fail "$fake_mapped was removed while mapped"
[[ -e /dev/shm/$s3 ]] && pass "the served segment $s3 is there" || fail "$s3 missing"

# --- 3. the file changed on disk, same config, reload ----------------------
older_than "$s3" 6
pid=$(sup_get 'w[0]["pid"]')
touch "$SUP_DIR/b.gguf"
"$DS4_BIN/ds4ctl" reload >/dev/null || fail "ds4ctl reload"
if sup_wait 60 's["model"]["segment"] != "'"$s3"'" and w[0]["state"] == "ready" and w[0]["pid"] != '"$pid"; then
  s4=$(sup_get 's["model"]["segment"]')
  segments+=("$s4")
  pass "reload after the file changed on disk: served from $s4, worker $(sup_get 'w[0]["pid"]') replaced $pid"
else
  fail "a changed model file was not picked up by the reload: $(sup_status | tr -d '\n' | cut -c1-300)"
fi
grep -q "reload: changed the model file $SUP_DIR/b.gguf (changed on disk)" "$SUP_DIR/sup.log" \
  && pass "the reload says why" || fail "no 'changed on disk' line in the log"
wait_gone "$s3" 10 && pass "the replaced file's segment $s3 was removed once its worker exited" || fail "$s3 still in /dev/shm"
sup_stop
[[ $SUP_RC == 0 ]] && pass "SIGTERM: clean exit" || fail "supervisor exit status $SUP_RC"
sup_finish 40
