#!/usr/bin/env bash
# The real-systemd harness works: a private user manager and the journal come
# up, a unit with MemoryMax= is OOM-killed by the kernel for real, the signals
# the supervisor's OOM watcher matches appear in the journal, and everything
# is cleaned up afterwards.
#
# Exit 0 = pass, 1 = fail, 77 = this machine cannot run it (reason printed).
set -u

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/systemd_env.sh"

fails=0
pass() { echo "ok   - $*"; }
fail() { echo "FAIL - $*"; fails=$((fails + 1)); }
note() { echo "note - $*"; }

ds4_systemd_start || exit $?
trap ds4_systemd_stop EXIT
mode=$DS4_SD_CGROUP_MODE
top=$DS4_SD_CGROUP_TOP
dir=$DS4_SD_DIR
mgr=$DS4_SD_MANAGER_PID
echo "cgroup mode: $mode, manager cgroup: $DS4_SD_CGROUP"

# --- The user manager answers, over its private socket and over the bus ---
state=$(systemctl --user is-system-running 2>&1)
[[ $state == running || $state == degraded ]] && pass "systemctl --user: $state" || fail "systemctl --user is-system-running: $state"
# busctl uses sd-bus's user-bus connection ($DBUS_SESSION_BUS_ADDRESS), the
# way the supervisor's sd_bus_open_user() does.
version=$(timeout 10 busctl --user get-property org.freedesktop.systemd1 /org/freedesktop/systemd1 \
  org.freedesktop.systemd1.Manager Version 2>&1)
[[ $version == s\ * ]] && pass "sd-bus user bus reaches the manager: $version" || fail "busctl --user: $version"

units=$HOME/.local/share/systemd/user
mkdir -p "$units"

# --- Specifiers and Type=notify, as ds4's own units use them ---
cat >"$units/spec.service" <<'EOF'
[Service]
Type=oneshot
ExecStart=/bin/sh -c 'echo "%h %t" > %t/spec.out'
EOF
cat >"$units/notifytest.service" <<'EOF'
[Service]
Type=notify
NotifyAccess=all
ExecStart=/bin/sh -c 'systemd-notify --ready; exec sleep 60'
EOF

# --- A unit the kernel OOM-kills: 64 MiB allowed, ~500 MiB touched ---
cat >"$units/oomtest.service" <<'EOF'
[Unit]
Description=ds4 harness OOM test
[Service]
Type=exec
MemoryMax=64M
OOMScoreAdjust=1000
ExecStart=/usr/bin/python3 -c 'import sys; print("oomtest allocating", flush=True); b = bytearray(500 << 20); print("oomtest survived", flush=True)'
EOF
if [[ ! -x /usr/bin/python3 ]]; then
  # tail keeps a line from /dev/zero, which never ends, in memory.
  sed -i 's|^ExecStart=.*|ExecStart=/bin/sh -c "echo oomtest allocating; exec tail /dev/zero"|' "$units/oomtest.service"
fi
cat >"$units/memprobe.service" <<'EOF'
[Service]
MemoryMax=64M
ExecStart=/bin/sleep 60
EOF
systemctl --user daemon-reload || fail "daemon-reload"

timeout 20 systemctl --user start spec.service || fail "start spec.service"
spec=$(cat "$XDG_RUNTIME_DIR/spec.out" 2>/dev/null)
[[ $spec == "$HOME $XDG_RUNTIME_DIR" ]] && pass "%h and %t are the isolated HOME and XDG_RUNTIME_DIR" \
  || fail "%h %t = '$spec', expected '$HOME $XDG_RUNTIME_DIR'"

if timeout 20 systemctl --user start notifytest.service; then
  [[ $(systemctl --user is-active notifytest.service) == active ]] && pass "Type=notify unit reached active" \
    || fail "notifytest.service not active"
else
  fail "Type=notify unit did not start"
fi
timeout 20 systemctl --user stop notifytest.service

# --- MemoryMax= reaches the cgroup (is the memory controller delegated?) ---
timeout 20 systemctl --user start memprobe.service || fail "start memprobe.service"
cg=$(systemctl --user show -P ControlGroup memprobe.service)
if [[ $mode == unified ]]; then limit_file=$DS4_SD_CGROOT$cg/memory.max
else limit_file=$DS4_SD_CGROOT/memory$cg/memory.limit_in_bytes; fi
limit=$(cat "$limit_file" 2>/dev/null)
if [[ $limit == 67108864 ]]; then
  pass "MemoryMax=64M is enforced: $limit_file = $limit"
else
  echo "SKIP: MemoryMax= does not reach the cgroup here ($limit_file = '${limit:-missing}'): the user manager has no memory controller, so no OOM kill can be provoked"
  exit 77
fi
timeout 20 systemctl --user stop memprobe.service

# --- The OOM kill ---
cursor=$(journalctl --show-cursor -n 0 -q 2>/dev/null | sed -n 's/^-- cursor: //p')
[[ -n $cursor ]] || fail "no journal cursor"
timeout 30 systemctl --user start oomtest.service
unit_done() {
  local s
  s=$(systemctl --user show -P ActiveState oomtest.service)
  [[ $s == failed || $s == inactive ]]
}
ds4_wait_until 30 unit_done || fail "oomtest.service still $(systemctl --user show -P ActiveState oomtest.service) after 30 s"
result=$(systemctl --user show -P Result oomtest.service)
status=$(systemctl --user show -P ExecMainStatus oomtest.service)
echo "oomtest.service: Result=$result ExecMainStatus=$status"

if [[ $mode == unified ]]; then
  [[ $result == oom-kill ]] && pass "(a) Result=oom-kill" || fail "(a) Result=$result, expected oom-kill"
else
  # systemd learns of OOM kills from memory.events, which only cgroup v2 has;
  # on v1 the unit just sees its main process die of SIGKILL.
  note "(a) cgroup $mode: systemd cannot report Result=oom-kill (memory.events is cgroup v2 only)"
  [[ $result == signal && $status == 9 ]] && pass "(a) Result=signal, ExecMainStatus=9 (SIGKILL)" \
    || fail "(a) Result=$result ExecMainStatus=$status, expected signal/9"
fi

# journald reads /dev/kmsg asynchronously: wait for the kernel line.
# --cursor, not --after-cursor: journalctl 252 with --after-cursor and field
# matches skips the first *matching* entry when the cursor's own entry does
# not match. The cursor's entry predates the test, so including it is harmless.
after=(--cursor "$cursor" --no-pager -q)
kernel_line() { journalctl "${after[@]}" -k -o cat 2>/dev/null | grep -m1 'oom-kill:.*task_memcg=[^,]*/oomtest\.service,'; }
if ds4_wait_until 10 kernel_line >/dev/null; then
  pass "(b) kernel: $(kernel_line)"
  journalctl "${after[@]}" -k -o cat | grep -m1 'Killed process' | sed 's/^/       /'
  journalctl "${after[@]}" -k -o cat | grep -q 'Killed process.*oom_score_adj:1000' \
    && pass "OOMScoreAdjust=1000 took effect" || fail "victim's oom_score_adj is not 1000"
else
  fail "(b) no kernel 'oom-kill:' line with task_memcg=.../oomtest.service in the journal"
fi

# journald handles each sender's datagrams in its own time: every lookup
# below waits (bounded) for its entry.
journal_has() { [[ -n $(journalctl "${after[@]}" "$@" 2>/dev/null) ]]; }
journal_wait() { ds4_wait_until 10 journal_has "$@"; }

sd_oom=(MESSAGE_ID=fe6faa94e7774663a0da52717891d8ef USER_UNIT=oomtest.service -o cat)
if [[ $mode == unified ]]; then
  journal_wait "${sd_oom[@]}" && pass "(b) systemd: $(journalctl "${after[@]}" "${sd_oom[@]}")" \
    || fail "(b) no 'killed by the OOM killer' entry (MESSAGE_ID=fe6faa94e7774663a0da52717891d8ef) for oomtest.service"
elif journal_wait USER_UNIT=oomtest.service MESSAGE_ID=d9b373ed55a64feb8242e02dbe79a49c && ! journal_has "${sd_oom[@]}"; then
  note "(b) no systemd 'killed by the OOM killer' entry, as expected on cgroup $mode"
else
  pass "(b) systemd: $(journalctl "${after[@]}" "${sd_oom[@]}")"
fi

failed=(USER_UNIT=oomtest.service MESSAGE_ID=d9b373ed55a64feb8242e02dbe79a49c -o export)
if journal_wait "${failed[@]}"; then
  pass "unit failure entry: USER_UNIT=oomtest.service $(journalctl "${after[@]}" "${failed[@]}" | grep -a '^UNIT_RESULT=' | tail -1)"
else
  fail "no 'Failed with result' entry for USER_UNIT=oomtest.service"
fi
exited=(USER_UNIT=oomtest.service MESSAGE_ID=98e322203f7a4ed290d09fe03c09fe15 -o cat)
journal_wait "${exited[@]}" && pass "process exit entry: $(journalctl "${after[@]}" "${exited[@]}" | tail -1)" \
  || fail "no 'Main process exited' entry for oomtest.service"
# The unit's own output is attributed to it (journald parses the cgroup).
journal_wait _SYSTEMD_USER_UNIT=oomtest.service -o cat \
  && pass "unit stdout is in the journal with _SYSTEMD_USER_UNIT=oomtest.service" \
  || fail "unit stdout not found under _SYSTEMD_USER_UNIT=oomtest.service"

# --- Cleanup leaves nothing behind ---
trap - EXIT
ds4_systemd_stop
kill -0 "$mgr" 2>/dev/null && fail "user manager $mgr still running"
[[ -e $dir ]] && fail "temp dir $dir still there"
left=$(ls -d "$DS4_SD_CGROOT"/*"$top" "$DS4_SD_CGROOT$top" 2>/dev/null)
[[ -z $left ]] && pass "cleanup: manager gone, temp dir and cgroups removed" || fail "cgroups left: $left"
ds4_journal_alive && pass "journald still answers (shared)" || fail "journald gone after cleanup"

if ((fails)); then echo "$fails failure(s)"; exit 1; fi
echo "all passed"
