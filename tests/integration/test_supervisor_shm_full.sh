#!/usr/bin/env bash
# /dev/shm with 0 bytes free (DESIGN.md: never SIGBUS): a supervisor whose
# model segment is already there (reused) but whose control block must be
# made anew exits with a clear error naming the control block, not SIGBUS
# (exit 135), and leaves no half-made block behind. Runs in a private mount
# namespace with its own small tmpfs on /dev/shm, so the machine's is never
# filled. Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
if [[ ${DS4_SHM_NS:-} != 1 ]]; then
  [[ $(id -u) == 0 ]] || { echo "SKIP: needs root to mount a private /dev/shm"; exit 77; }
  command -v unshare >/dev/null || { echo "SKIP: unshare (util-linux) is not installed"; exit 77; }
  unshare -m --propagation private true 2>/dev/null || { echo "SKIP: cannot make a mount namespace here"; exit 77; }
  exec unshare -m --propagation private env DS4_SHM_NS=1 bash "$0" "$@"
fi
mount -t tmpfs -o size=8m,mode=1777 ds4-test-shm /dev/shm || { echo "SKIP: cannot mount a tmpfs on /dev/shm"; exit 77; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"
sup_begin
unset DBUS_SESSION_BUS_ADDRESS

cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $model
  name: stories
proxy:
  listen: 127.0.0.1:0
workers:
  backend: process
  device: cpu
  threads: 1
  context:
    ladder: [256]
headroom:
  min_available: 16MiB
YAML

sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; sup_finish; }
sup_wait 60 'w[0]["state"] == "ready"' || fail "no ready worker"
sup_stop
ls /dev/shm/ds4-model-* >/dev/null 2>&1 && pass "the model segment stays after a stop" || fail "no model segment"

# Fill what is left, and take the control block away: the next start reuses the
# model segment and must make a new control block in a /dev/shm with 0 bytes free.
rm -f /dev/shm/ds4-control-*
head -c 64M /dev/zero >/dev/shm/ds4-test-fill 2>/dev/null
free=$(df --output=avail -B1 /dev/shm | tail -1 | tr -d ' ')
[[ $free == 0 ]] && pass "/dev/shm has 0 bytes free" || fail "/dev/shm still has $free bytes free"

: >"$SUP_DIR/sup.log"
timeout 60 "$DS4_BIN/ds4-supervisor" --config "$SUP_DIR/ds4.yaml" >>"$SUP_DIR/sup.log" 2>&1
rc=$?
((rc != 0 && rc != 135 && rc != 124)) && pass "the start failed cleanly (exit $rc)" || fail "exit status $rc (135 is SIGBUS, 124 a hang)"
grep -q "control block /dev/shm/ds4-control-.*cannot reserve .*(/dev/shm is full)" "$SUP_DIR/sup.log" \
  && pass "said: $(grep -m1 'control block' "$SUP_DIR/sup.log" | cut -c1-200)" \
  || fail "no error naming the control block: $(tail -3 "$SUP_DIR/sup.log" | tr '\n' ' ')"
ls /dev/shm/ds4-control-* >/dev/null 2>&1 && fail "a half-made control block was left" || pass "no half-made control block left"
sup_finish
