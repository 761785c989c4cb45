#!/usr/bin/env bash
# The public port outlives the supervisor: the shipped ds4-supervisor.socket
# and ds4-supervisor.service under a real user manager (lib/systemd_env.sh).
# The supervisor takes the unit's listening socket (journal:
# DS4_EVENT=socket_inherited). Then, three times, the supervisor is SIGKILLed
# and 8 clients connect at once while it is down: none is refused; each is
# answered by the restarted supervisor, which adopts the running worker.
# Prints the longest such wait (RestartSec plus the start). Without the
# socket unit (stopped), the same kill leaves the port closed: connections
# are refused, which is what the socket unit is for.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/systemd_env.sh"
. "$here/lib/supervisor_env.sh"

model=${DS4_MODELS:-${DS4_SRC:-}/../shared/models}/stories260K.gguf
[[ -f $model ]] || { echo "SKIP: no $model"; exit 77; }
command -v curl >/dev/null || { echo "SKIP: no curl"; exit 77; }
ds4_systemd_start || exit $?
SUP_PRIVATE_RUNTIME=0 sup_init || { ds4_systemd_stop; exit 77; }
cleanup() {
  timeout 30 systemctl --user stop ds4-supervisor.service ds4-supervisor.socket >/dev/null 2>&1
  sup_cleanup
  ds4_systemd_stop
}
trap cleanup EXIT
cursor=$(journalctl --show-cursor -n 0 -q 2>/dev/null | sed -n 's/^-- cursor: //p')

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url=http://127.0.0.1:$port
mkdir -p "$HOME/.local/bin" "$HOME/.local/share/systemd/user" "$HOME/.config/ds4" \
  "$HOME/.config/systemd/user/ds4-supervisor.socket.d"
for b in ds4-supervisor ds4-worker ds4ctl; do ln -sf "$DS4_BIN/$b" "$HOME/.local/bin/$b"; done
cp "$DS4_SRC/systemd/ds4-supervisor.service" "$DS4_SRC/systemd/ds4-supervisor.socket" "$HOME/.local/share/systemd/user/"
# The address as the socket unit's comment says to set it.
printf '[Socket]\nListenStream=\nListenStream=127.0.0.1:%s\n' "$port" \
  >"$HOME/.config/systemd/user/ds4-supervisor.socket.d/50-port.conf"
cat >"$HOME/.config/ds4/ds4.yaml" <<YAML
model:
  path: $model
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
if timeout 60 systemctl --user start ds4-supervisor.service; then pass "ds4-supervisor.service started"
else
  fail "ds4-supervisor.service did not start"
  journalctl --no-pager -q -n 30 --user-unit ds4-supervisor.service
  sup_finish
fi
[[ $(systemctl --user is-active ds4-supervisor.socket) == active ]] && pass "the service brought ds4-supervisor.socket up" \
  || fail "ds4-supervisor.socket is $(systemctl --user is-active ds4-supervisor.socket)"
sup_wait 30 'w[0]["state"] == "ready"' || fail "worker not ready: $(sup_status | tr -d '\n' | cut -c1-400)"
ds4_wait_until 10 eval '[[ -n $(journalctl --cursor "$cursor" --no-pager -q -o cat SYSLOG_IDENTIFIER=ds4-supervisor DS4_EVENT=socket_inherited 2>/dev/null) ]]' \
  && pass "journal: the supervisor listens on the socket systemd holds" || fail "no DS4_EVENT=socket_inherited entry"

# complete N OUT: N concurrent completions; each line of OUT: HTTP status and seconds.
complete() {
  local i pids=()
  for ((i = 0; i < $1; i++)); do
    curl -s -o /dev/null -w '%{http_code} %{time_total}\n' --max-time 60 "$url/v1/completions" \
      -H 'content-type: application/json' -d '{"prompt":"Once upon a time","max_tokens":8,"temperature":0}' >>"$2" &
    pids+=($!)
  done
  wait "${pids[@]}"  # not the harness's own background jobs
}
rm -f "$SUP_DIR/warm"
complete 2 "$SUP_DIR/warm"
[[ $(cut -d' ' -f1 "$SUP_DIR/warm" | sort -u) == 200 ]] && pass "served through the socket unit's port" || fail "warm-up: $(cat "$SUP_DIR/warm")"

wpid=$(sup_get 'w[0]["pid"]')
longest=0
for round in 1 2 3; do
  sup_pid=$(systemctl --user show -P MainPID ds4-supervisor.service)
  out=$SUP_DIR/round$round
  rm -f "$out"
  kill -9 "$sup_pid"
  complete 8 "$out"
  codes=$(cut -d' ' -f1 "$out" | sort | uniq -c | tr -s ' ' | tr '\n' ',')
  if [[ $(cut -d' ' -f1 "$out" | sort -u) == 200 && $(wc -l <"$out") == 8 ]]; then
    pass "round $round: supervisor $sup_pid SIGKILLed, 8 clients connecting meanwhile all answered (${codes%,})"
  else
    fail "round $round: $(tr '\n' ' ' <"$out")"
  fi
  t=$(sort -g -k2 "$out" | tail -1 | cut -d' ' -f2)
  longest=$(python3 -c "print(max($longest, ${t:-0}))")
  sup_wait 30 'w[0]["state"] == "ready"' || fail "round $round: worker not ready after the restart"
done
echo "longest wait of a client that connected while the supervisor was down: ${longest} s"
[[ $(sup_get 'w[0]["pid"]') == "$wpid" ]] && pass "the worker kept running and was adopted each time (pid $wpid)" \
  || fail "the worker was replaced: pid $(sup_get 'w[0]["pid"]'), was $wpid"

# Without the socket unit the port closes with the supervisor.
timeout 30 systemctl --user stop ds4-supervisor.service ds4-supervisor.socket
rm "$HOME/.local/share/systemd/user/ds4-supervisor.socket"
systemctl --user daemon-reload
if timeout 60 systemctl --user start ds4-supervisor.service && sup_wait 30 'w[0]["state"] == "ready"'; then
  pass "without the socket unit the supervisor binds proxy.listen itself"
  sup_pid=$(systemctl --user show -P MainPID ds4-supervisor.service)
  kill -9 "$sup_pid"
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$url/health")
  [[ $code == 000 ]] && pass "and a client connecting after its SIGKILL is refused (what the socket unit prevents)" \
    || fail "without the socket unit, /health right after the kill: HTTP $code"
else
  fail "the supervisor did not start without the socket unit"
fi
sup_finish
