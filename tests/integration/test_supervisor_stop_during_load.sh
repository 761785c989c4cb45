#!/usr/bin/env bash
# A stop while the supervisor loads the model (before it serves: minutes for
# 80 GB): SIGTERM (systemctl stop) or SIGINT (Ctrl-C) ends the load at its
# next chunk, removes the half-written segment this supervisor created, logs
# "stopped during the model load: ..." and exits 0 within a few seconds; the
# next start loads the model afresh and serves. Process backend, on a
# synthetic 826 MB model (a load of a second or more here).
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"

[[ -d /dev/shm && -w /dev/shm ]] || { echo "SKIP: no writable /dev/shm"; exit 77; }
sup_init || exit $?
unset DBUS_SESSION_BUS_ADDRESS
: >"$SUP_DIR/sup.log"
trap sup_cleanup EXIT

model=$SUP_DIR/big.gguf
sup_synthetic_model "$model" --preset 207m --type f32
need=$(($(stat -c %s "$model") + (64 << 20)))
(($(df -B1 --output=avail /dev/shm | tail -1) > need)) || { echo "SKIP: /dev/shm has no room for $model"; exit 77; }
cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $model
  name: big
  backing: shm
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

# signal_mid_load SIG: waits (at most 60 s) until the supervisor $SUP_PID
# (or the supervisor its keeper runs) copies tensors into a segment it
# created (its header: state loading, loader_pid, 0 < bytes_done < 90% of the
# segment), then sends $SUP_PID
# SIG and prints that segment's name (how far it got goes to stderr). Fails
# when the load got past that first.
signal_mid_load() {
  python3 - "$SUP_PID" "$1" <<'PY'
import glob, os, signal, struct, sys, time
pid, sig = int(sys.argv[1]), getattr(signal, "SIG" + sys.argv[2])
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    for path in glob.glob("/dev/shm/ds4-model-*"):
        try:
            with open(path, "rb") as f:
                head = f.read(40)
        except OSError:
            continue
        if len(head) < 40 or head[:8] != b"DS4MODEL":
            continue
        # SegmentHeader (shared/model_store.h): magic, layout_version, state,
        # total_bytes, loader_pid, bytes_done.
        _, state, total, loader, done = struct.unpack_from("<IIQqQ", head, 8)
        # The supervisor loads, or (started by hand) its child under the keeper.
        try:
            parent = int(open("/proc/%d/stat" % loader).read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            parent = 0
        if loader != pid and parent != pid:
            continue
        if state != 0 or done >= total * 9 // 10:
            sys.exit("the load got to %d of %d bytes (state %d) before it could be signalled" % (done, total, state))
        if done > 0:
            os.kill(pid, sig)
            print(os.path.basename(path))
            print("SIG%s at %d of %d bytes" % (sys.argv[2], done, total), file=sys.stderr)
            sys.exit(0)
    time.sleep(0.002)
sys.exit("no segment of pid %d was being loaded within 60 s" % pid)
PY
}

# wait_exit SECONDS: waits for $SUP_PID to end; sets SUP_RC (its exit status,
# or "running" when it did not end in time: then it is killed).
wait_exit() {
  local i
  for i in $(seq $(($1 * 20))); do kill -0 "$SUP_PID" 2>/dev/null || break; sleep 0.05; done
  if kill -0 "$SUP_PID" 2>/dev/null; then
    kill -KILL "$SUP_PID"
    wait "$SUP_PID" 2>/dev/null
    SUP_RC=running
  else
    wait "$SUP_PID"
    SUP_RC=$?
  fi
  SUP_PID=
}

for sig in TERM INT; do
  before=$(grep -c 'stopped during the model load' "$SUP_DIR/sup.log" 2>/dev/null)
  "$DS4_BIN/ds4-supervisor" --config "$SUP_DIR/ds4.yaml" >>"$SUP_DIR/sup.log" 2>&1 &
  SUP_PID=$!
  if ! segment=$(signal_mid_load "$sig"); then
    fail "SIG$sig: could not signal the supervisor mid-load"
    sup_finish
  fi
  SUP_SEGMENTS+=("$segment")
  sent=${EPOCHREALTIME/[.,]/}
  wait_exit 5
  took=$(((${EPOCHREALTIME/[.,]/} - sent) / 1000))
  [[ $SUP_RC == 0 ]] && pass "SIG$sig mid-load: exit status 0 after $took ms" \
    || fail "SIG$sig mid-load: exit status $SUP_RC (143 = killed by SIGTERM, 130 = by SIGINT) after $took ms"
  line=$(grep 'stopped during the model load: ' "$SUP_DIR/sup.log" | tail -1)
  (($(grep -c 'stopped during the model load' "$SUP_DIR/sup.log") == before + 1)) \
    && pass "SIG$sig: logged: $(cut -c1-200 <<<"$line")" || fail "SIG$sig: no 'stopped during the model load: ...' line"
  [[ ! -e /dev/shm/$segment ]] && pass "SIG$sig: the half-written segment $segment is removed" \
    || fail "SIG$sig: /dev/shm/$segment ($(stat -c %s "/dev/shm/$segment") bytes) left behind"
done

# The next start loads the model afresh (nothing half-written to rebuild) and serves.
sup_start "$SUP_DIR/ds4.yaml" || { fail "the supervisor did not start again"; sup_finish; }
SUP_SEGMENTS+=("$(sup_get 's["model"]["segment"]')")
url=$(sup_proxy_url)
code=000
for _ in $(seq 300); do
  code=$(curl -s -o /dev/null --max-time 5 -w '%{http_code}' "$url/health")
  [[ $code == 200 ]] && break
  sleep 0.1
done
[[ $code == 200 ]] && pass "the next start serves: /health 200" || fail "the next start: /health $code"
grep -q 'rebuilt model segment' "$SUP_DIR/sup.log" \
  && fail "the next start found a half-written segment: $(grep -m1 'rebuilt model segment' "$SUP_DIR/sup.log" | cut -c1-200)" \
  || pass "the next start found nothing half-written"
grep -q "model big in segment ${SUP_SEGMENTS[-1]} .*, loaded)" "$SUP_DIR/sup.log" \
  && pass "the next start loaded ${SUP_SEGMENTS[-1]}" || fail "the next start did not log loading ${SUP_SEGMENTS[-1]}"
sup_stop
[[ $SUP_RC == 0 ]] && pass "SIGTERM once serving: exit status 0" || fail "SIGTERM once serving: exit status $SUP_RC"
sup_finish 30
