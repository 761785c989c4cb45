#!/usr/bin/env bash
# Nothing lost when the supervisor itself dies (DESIGN.md). The shipped units
# under a real user manager (lib/systemd_env.sh): ds4-supervisor.socket holds
# the port, each client connection and its journal sit in the service's fd
# store. 8 clients through the official SDKs (proxy_load.mjs: greedy, half of
# them streamed, chat, Anthropic messages and completions) run 2000 requests
# undisturbed, then again while the supervisor is SIGKILLed three times. Every
# answer must equal the undisturbed one (streams token by token: no gap, no
# repeat) and none may fail; the restarted supervisor takes the connections
# back (journal: DS4_EVENT=connections_adopted), loses none
# (DS4_EVENT=connection_lost) and adopts the running worker. Prints the
# largest pause a streaming client saw. Last, the same kills with no room for
# connections in the fd store (FileDescriptorStoreMax=4, the segments' only)
# must lose requests: what the journal is for. Then the same 2000 requests
# and 3 kills with the process backend, the supervisor started by hand: its
# keeper (supervisor/keeper.h) is the fd store and restarts it, and the
# worker outlives each supervisor and is adopted; a SIGKILL of the keeper
# itself ends the worker.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
# The load's own verdict decides a run piped into tee, not tee's.
set -o pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/systemd_env.sh"
. "$here/lib/supervisor_env.sh"

model=${DS4_MODELS:-${DS4_SRC:-}/../shared/models}/stories260K.gguf
[[ -f $model ]] || { echo "SKIP: no $model"; exit 77; }
command -v curl >/dev/null || { echo "SKIP: no curl"; exit 77; }
command -v node >/dev/null || { echo "SKIP: no node"; exit 77; }
for p in openai @anthropic-ai/sdk; do
  [[ -d ${DS4_SRC:-}/tests/js/node_modules/$p ]] || { echo "SKIP: npm package $p is missing (npm install in tests/js)"; exit 77; }
done
ds4_systemd_start || exit $?
SUP_PRIVATE_RUNTIME=0 sup_init || { ds4_systemd_stop; exit 77; }
cleanup() {
  timeout 30 systemctl --user stop ds4-supervisor.service ds4-supervisor.socket >/dev/null 2>&1
  sup_cleanup
  ds4_systemd_stop
}
trap cleanup EXIT
cursor=$(journalctl --show-cursor -n 0 -q 2>/dev/null | sed -n 's/^-- cursor: //p')
events() { journalctl --cursor "$cursor" --no-pager -q -o cat SYSLOG_IDENTIFIER=ds4-supervisor "$@" 2>/dev/null; }

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url=http://127.0.0.1:$port
mkdir -p "$HOME/.local/bin" "$HOME/.local/share/systemd/user" "$HOME/.config/ds4" \
  "$HOME/.config/systemd/user/ds4-supervisor.socket.d"
for b in ds4-supervisor ds4-worker ds4ctl; do ln -sf "$DS4_BIN/$b" "$HOME/.local/bin/$b"; done
cp "$DS4_SRC/systemd/ds4-supervisor.service" "$DS4_SRC/systemd/ds4-supervisor.socket" "$HOME/.local/share/systemd/user/"
printf '[Socket]\nListenStream=\nListenStream=127.0.0.1:%s\n' "$port" \
  >"$HOME/.config/systemd/user/ds4-supervisor.socket.d/50-port.conf"
cat >"$HOME/.config/ds4/ds4.yaml" <<YAML
model:
  path: $model
  name: stories
proxy:
  listen: 127.0.0.1:$port
workers:
  backend: systemd
  device: cpu
  slots: 8
  threads: 1
  context:
    ladder: [256]
  reserve: 16MiB
headroom:
  min_available: 16MiB
YAML
systemctl --user daemon-reload
if ! timeout 60 systemctl --user start ds4-supervisor.service; then
  fail "ds4-supervisor.service did not start"
  journalctl --no-pager -q -n 30 --user-unit ds4-supervisor.service
  sup_finish
fi
sup_wait 30 'w[0]["state"] == "ready"' || { fail "worker not ready: $(sup_status | tr -d '\n' | cut -c1-400)"; sup_finish; }
wpid=$(sup_get 'w[0]["pid"]')

cd "$DS4_SRC/tests/js" || exit 1
echo "undisturbed run:"
timeout 300 node proxy_load.mjs --base "$url" --requests 2000 --concurrency 8 --max-tokens 48 --out "$SUP_DIR/ref.json" ||
  { fail "the undisturbed run"; sup_finish; }

# Each fault: once the supervisor serves again (active, the worker ready),
# a random 0-40 ms later, SIGKILL its main process.
echo 0 >"$SUP_DIR/faults"
cat >"$SUP_DIR/fault.sh" <<EOS
#!/usr/bin/env bash
export XDG_RUNTIME_DIR=$XDG_RUNTIME_DIR DBUS_SESSION_BUS_ADDRESS=${DBUS_SESSION_BUS_ADDRESS:-}
n=\$((\$(cat $SUP_DIR/faults) + 1)); echo \$n >$SUP_DIR/faults
for _ in \$(seq 300); do
  [[ \$(systemctl --user is-active ds4-supervisor.service) == active ]] &&
    "$DS4_BIN/ds4ctl" status --json 2>/dev/null | grep -q '"state": *"ready"' && break
  sleep 0.05
done
sleep 0.0\$((RANDOM % 4))\$((RANDOM % 10))
pid=\$(systemctl --user show -P MainPID ds4-supervisor.service)
echo "fault \$n: kill -9 \$pid (the supervisor)" >>$SUP_DIR/faults.log
kill -9 "\$pid"
EOS
chmod +x "$SUP_DIR/fault.sh"
echo "run with 3 SIGKILLs of the supervisor:"
if timeout 400 node proxy_load.mjs --base "$url" --requests 2000 --concurrency 8 --max-tokens 48 \
     --reference "$SUP_DIR/ref.json" --fault-cmd "$SUP_DIR/fault.sh" --faults 3 | tee "$SUP_DIR/summary"; then
  pass "0 failed of 2000, every answer identical to the undisturbed run's"
else
  fail "requests lost or changed by the supervisor's SIGKILLs"
fi
sed 's/^/     /' "$SUP_DIR/faults.log"
[[ $(cat "$SUP_DIR/faults") == 3 ]] && pass "3 faults ran" || fail "$(cat "$SUP_DIR/faults") faults ran, not 3"
echo "largest pause a streaming client saw: $(head -1 "$SUP_DIR/summary" | python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["largest_stream_pause_ms"])') ms"
sup_wait 30 'w[0]["state"] == "ready"' || fail "worker not ready after the last restart"
restarts=$(systemctl --user show -P NRestarts ds4-supervisor.service)
[[ $restarts == 3 ]] && pass "systemd restarted the supervisor 3 times" || fail "NRestarts=$restarts"
[[ $(sup_get 'w[0]["pid"]') == "$wpid" ]] && pass "the worker kept running and was adopted each time (pid $wpid)" \
  || fail "the worker was replaced: pid $(sup_get 'w[0]["pid"]'), was $wpid"
adopted=$(events DS4_EVENT=connections_adopted)
read -r continued mid < <(events DS4_EVENT=connections_adopted -o json | python3 -c '
import json, sys
e = [json.loads(l) for l in sys.stdin if l.strip()]
print(sum(int(x.get("DS4_CONTINUED", 0)) for x in e), sum(int(x.get("DS4_MID_ANSWER", 0)) for x in e))')
echo "$adopted" | sed 's/^/     /'
((continued > 0)) && pass "the restarted supervisors took back $continued connections from the fd store and went on with them" \
  || fail "no connection was taken back (DS4_EVENT=connections_adopted)"
((mid > 0)) && pass "$mid of them were mid-answer and their answers went on" || fail "no answer was under way at a kill"
lost=$(events DS4_EVENT=connection_lost)
[[ -z $lost ]] && pass "no connection was lost (DS4_EVENT=connection_lost)" || fail "connections lost: $lost"

# Without room for connections in the store, the same kills lose requests.
mkdir -p "$HOME/.config/systemd/user/ds4-supervisor.service.d"
printf '[Service]\nFileDescriptorStoreMax=4\n' >"$HOME/.config/systemd/user/ds4-supervisor.service.d/50-small.conf"
systemctl --user daemon-reload
timeout 60 systemctl --user restart ds4-supervisor.service || fail "restart with FileDescriptorStoreMax=4"
sup_wait 30 'w[0]["state"] == "ready"' || fail "worker not ready with FileDescriptorStoreMax=4"
echo 0 >"$SUP_DIR/faults"
: >"$SUP_DIR/faults.log"
timeout 400 node proxy_load.mjs --base "$url" --requests 2000 --concurrency 8 --max-tokens 48 \
  --reference "$SUP_DIR/ref.json" --fault-cmd "$SUP_DIR/fault.sh" --faults 3 >"$SUP_DIR/summary_small"
failed=$(head -1 "$SUP_DIR/summary_small" | python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["failed"])')
((failed > 0)) && pass "without room in the fd store, the same 3 kills failed $failed of 2000 requests (what the journal prevents)" \
  || fail "without room in the fd store nothing failed: the check above proves nothing ($(cat "$SUP_DIR/summary_small"))"
timeout 30 systemctl --user stop ds4-supervisor.service ds4-supervisor.socket

# The process backend, by hand: the keeper holds the port and the store.
sed -e 's/backend: systemd/backend: process/' "$HOME/.config/ds4/ds4.yaml" >"$SUP_DIR/process.yaml"
sup_start "$SUP_DIR/process.yaml" || fail "the supervisor (process backend, by hand) did not start"
sup_wait 30 'w[0]["state"] == "ready"' || fail "process backend: worker not ready"
wpid=$(sup_get 'w[0]["pid"]')
echo 0 >"$SUP_DIR/faults"
: >"$SUP_DIR/faults.log"
cat >"$SUP_DIR/fault_process.sh" <<EOS
#!/usr/bin/env bash
export XDG_RUNTIME_DIR=$XDG_RUNTIME_DIR
n=\$((\$(cat $SUP_DIR/faults) + 1)); echo \$n >$SUP_DIR/faults
for _ in \$(seq 300); do
  "$DS4_BIN/ds4ctl" status --json 2>/dev/null | grep -q '"state": *"ready"' && break
  sleep 0.05
done
sleep 0.0\$((RANDOM % 4))\$((RANDOM % 10))
pid=\$(pgrep -P $SUP_PID -x ds4-supervisor)
echo "fault \$n: kill -9 \$pid (the supervisor under its keeper $SUP_PID)" >>$SUP_DIR/faults.log
kill -9 "\$pid"
EOS
chmod +x "$SUP_DIR/fault_process.sh"
echo "process backend, run with 3 SIGKILLs of the supervisor:"
if timeout 400 node proxy_load.mjs --base "$url" --requests 2000 --concurrency 8 --max-tokens 48 \
     --reference "$SUP_DIR/ref.json" --fault-cmd "$SUP_DIR/fault_process.sh" --faults 3 | tee "$SUP_DIR/summary_process"; then
  pass "process backend: 0 failed of 2000, every answer identical to the undisturbed run's"
else
  fail "process backend: requests lost or changed by the supervisor's SIGKILLs"
fi
sed 's/^/     /' "$SUP_DIR/faults.log"
[[ $(cat "$SUP_DIR/faults") == 3 ]] && pass "process backend: 3 faults ran" || fail "process backend: $(cat "$SUP_DIR/faults") faults ran"
echo "process backend: largest pause a streaming client saw: $(head -1 "$SUP_DIR/summary_process" | python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["largest_stream_pause_ms"])') ms"
restarts=$(grep -c 'DS4_EVENT=supervisor_restart,' "$SUP_DIR/sup.log")
[[ $restarts == 3 ]] && pass "the keeper started the supervisor again 3 times" || fail "keeper restarts: $restarts"
grep -q 'connection_lost' "$SUP_DIR/sup.log" && fail "process backend: connections lost: $(grep 'connection_lost' "$SUP_DIR/sup.log" | head -3)" \
  || pass "process backend: no connection was lost"
sup_wait 30 'w[0]["state"] == "ready"' || fail "process backend: worker not ready after the last restart"
[[ $(sup_get 'w[0]["pid"]') == "$wpid" ]] && pass "process backend: the worker outlived each supervisor and was adopted (pid $wpid)" \
  || fail "process backend: the worker was replaced: pid $(sup_get 'w[0]["pid"]'), was $wpid"
sup_stop
[[ ${SUP_RC:-1} == 0 ]] && pass "process backend: SIGTERM to the keeper is a clean stop (exit 0)" || fail "process backend: exit ${SUP_RC:-?}"
kill -0 "$wpid" 2>/dev/null && fail "process backend: worker $wpid still runs after the stop" || pass "process backend: the stop ended the worker"
# The keeper's own SIGKILL ends everything: its supervisor (PDEATHSIG) and the workers (they watch its pid).
sup_start "$SUP_DIR/process.yaml" || fail "the supervisor (process backend) did not start again"
if sup_wait 30 'w[0]["state"] == "ready"'; then
  wpid=$(sup_get 'w[0]["pid"]')
  kill -KILL "$SUP_PID"
  wait "$SUP_PID" 2>/dev/null
  SUP_PID=
  gone() { ! kill -0 "$wpid" 2>/dev/null; }
  ds4_wait_until 10 gone && pass "SIGKILL of the keeper: its worker $wpid ended too" || fail "worker $wpid outlived the keeper"
else
  fail "process backend: worker not ready at the second start"
fi
sup_finish
