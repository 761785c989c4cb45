# shellcheck shell=bash
# Real journald and a private `systemd --user` for integration tests, on a
# machine where systemd is not PID 1 (containers, firecracker VMs, CI).
#
# Usage (from a test script, as root):
#   . "$DS4_SRC/tests/integration/lib/systemd_env.sh"
#   ds4_systemd_start || exit $?      # 77 = cannot work here (reason printed)
#   trap ds4_systemd_stop EXIT
#   systemctl --user ...; journalctl ...; sd_bus_open_user() works too
#
# What ds4_systemd_start does:
#   - creates /run/systemd/system/ (what sd_booted() and systemctl look for);
#   - starts /lib/systemd/systemd-journald once if nothing answers on
#     /run/systemd/journal/socket. It is left running on purpose and shared by
#     all tests (it is the machine's journal; stopping it would lose entries
#     another test is still waiting for);
#   - starts `systemd --user` with a fresh HOME and XDG_RUNTIME_DIR under a
#     temp dir and exports them, plus DBUS_SESSION_BUS_ADDRESS (the user bus
#     is dbus.socket of that manager, dbus-user-session on Debian 12);
#   - puts the manager in a cgroup of its own (see DS4_SD_CGROUP) in every
#     mounted hierarchy first. A user manager started in the root cgroup
#     believes it owns the whole tree and moves every process of the machine
#     (PID 1 included) into its init.scope.
# Every wait is bounded. ds4_systemd_stop undoes all of it except journald.
#
# Exported after a successful start:
#   XDG_RUNTIME_DIR HOME DBUS_SESSION_BUS_ADDRESS  the manager's environment
#   DS4_SD_DIR        temp dir holding run/, home/, user-generators/ and manager.log
#                     (user-generators/ is searched by the manager for user
#                     generators before the system's folders: a test puts
#                     one there instead of /usr/local/lib/systemd/user-generators)
#   DS4_SD_CGROUP     the manager's cgroup path, relative to each hierarchy's
#                     root: /ds4-test-<pid>-<rand>.slice/user@0.service
#   DS4_SD_CGROUP_TOP the slice above it (removed by ds4_systemd_stop)
#   DS4_SD_MANAGER_PID
#   DS4_SD_CGROUP_MODE  unified | hybrid | legacy

DS4_SD_JOURNALD=${DS4_SD_JOURNALD:-/lib/systemd/systemd-journald}
DS4_SD_SYSTEMD=${DS4_SD_SYSTEMD:-/lib/systemd/systemd}
DS4_SD_CGROOT=${DS4_SD_CGROOT:-/sys/fs/cgroup}

ds4_log() { echo "[systemd_env] $*" >&2; }

# ds4_wait_until SECONDS CMD...: run CMD every 50 ms until it succeeds;
# returns 1 after SECONDS.
ds4_wait_until() {
  local timeout=$1; shift
  local now deadline
  now=${EPOCHREALTIME/[.,]/}
  deadline=$((now + timeout * 1000000))
  while true; do
    "$@" && return 0
    now=${EPOCHREALTIME/[.,]/}
    ((now >= deadline)) && return 1
    sleep 0.05
  done
}

# Which cgroup layout the machine has: unified (v2 only), hybrid (v1
# controllers + v2 at /sys/fs/cgroup/unified), legacy (v1 only).
ds4_cgroup_mode() {
  if [[ -f $DS4_SD_CGROOT/cgroup.controllers ]]; then echo unified
  elif [[ -f $DS4_SD_CGROOT/unified/cgroup.controllers ]]; then echo hybrid
  else echo legacy; fi
}

# Every hierarchy directory in which the manager gets its own cgroup.
ds4_cgroup_hierarchies() {
  if [[ $(ds4_cgroup_mode) == unified ]]; then
    echo "$DS4_SD_CGROOT"
    return
  fi
  local d
  for d in "$DS4_SD_CGROOT"/*/; do
    d=${d%/}
    [[ -f $d/cgroup.procs ]] && echo "$d"
  done
}

ds4_journal_alive() {
  [[ -S /run/systemd/journal/socket ]] || return 1
  # systemd-cat fails when nothing accepts on the stdout stream socket.
  systemd-cat -t ds4-test-probe true 2>/dev/null
}

# Make sure a journald answers; start one if not. Idempotent, and safe when
# tests run in parallel (one starts it, under a lock, the others wait).
ds4_journal_ensure() {
  mkdir -p /run/systemd/system /run/systemd/journal
  ds4_journal_alive && return 0
  local lock rc=0
  exec {lock}>/run/ds4-journald.lock
  if ! flock -w 20 "$lock"; then
    exec {lock}>&-
    DS4_SD_SKIP_REASON="timed out waiting for /run/ds4-journald.lock"
    return 77
  fi
  ds4_journal_start_locked || rc=$?
  exec {lock}>&-
  return "$rc"
}

ds4_journal_start_locked() {
  ds4_journal_alive && return 0
  if [[ ! -x $DS4_SD_JOURNALD ]]; then
    DS4_SD_SKIP_REASON="no journal at /run/systemd/journal/socket and no $DS4_SD_JOURNALD to start"
    return 77
  fi
  # A stale socket from a dead journald would make it fail to bind.
  rm -f /run/systemd/journal/socket /run/systemd/journal/stdout /run/systemd/journal/dev-log
  # setsid: it must outlive this test and ctest's process-group kill on
  # timeout. And no inherited descriptor: a journald holding this start's
  # lock, or a lock its caller holds around the whole test run (flock ...
  # ctest), would keep it held for good.
  (
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      ((fd > 2)) && eval "exec $fd>&-" 2>/dev/null
    done
    exec setsid "$DS4_SD_JOURNALD" </dev/null >>/run/ds4-journald.log 2>&1
  ) &
  if ! ds4_wait_until 10 ds4_journal_alive; then
    DS4_SD_SKIP_REASON="started $DS4_SD_JOURNALD but it did not answer on /run/systemd/journal/socket within 10 s (see /run/ds4-journald.log)"
    return 77
  fi
  ds4_log "started systemd-journald (shared between tests, left running)"
}

ds4_manager_ready() {
  [[ -S $XDG_RUNTIME_DIR/systemd/private ]] || return 1
  local state
  state=$(systemctl --user is-system-running 2>/dev/null)
  [[ $state == running || $state == degraded ]]
}

# The manager owns org.freedesktop.systemd1 on the user bus (an activatable
# name does not count: that only means dbus could start it).
ds4_manager_on_bus() {
  timeout 5 busctl --user status org.freedesktop.systemd1 2>/dev/null | grep -q "^PID=[0-9]"
}

ds4_systemd_start() {
  DS4_SD_SKIP_REASON=
  if ((EUID != 0)); then
    echo "SKIP: the systemd harness needs root (it starts journald and manages cgroups)" >&2
    return 77
  fi
  if [[ ! -x $DS4_SD_SYSTEMD ]]; then
    echo "SKIP: no $DS4_SD_SYSTEMD to run as a user manager" >&2
    return 77
  fi
  if [[ -n ${DS4_SD_DIR:-} ]]; then
    ds4_log "already started ($DS4_SD_DIR)"
    return 0
  fi
  local rc=0
  ds4_journal_ensure || rc=$?
  if ((rc != 0)); then echo "SKIP: $DS4_SD_SKIP_REASON" >&2; return "$rc"; fi

  DS4_SD_DIR=$(mktemp -d /tmp/ds4-systemd.XXXXXX) || return 1
  # Shaped like a real user manager's cgroup so that journald derives
  # _SYSTEMD_USER_UNIT= for the units' processes (it parses
  # <slices>/user@UID.service/<slices>/<unit>).
  DS4_SD_CGROUP_TOP=/ds4-test-$$-${DS4_SD_DIR##*.}.slice
  DS4_SD_CGROUP=$DS4_SD_CGROUP_TOP/user@$EUID.service
  DS4_SD_CGROUP_MODE=$(ds4_cgroup_mode)
  export DS4_SD_DIR DS4_SD_CGROUP DS4_SD_CGROUP_TOP DS4_SD_CGROUP_MODE
  mkdir -p "$DS4_SD_DIR/run" "$DS4_SD_DIR/home" "$DS4_SD_DIR/user-generators"
  chmod 700 "$DS4_SD_DIR/run"

  local h
  while read -r h; do
    mkdir -p "$h$DS4_SD_CGROUP" || { echo "SKIP: cannot create cgroup $h$DS4_SD_CGROUP" >&2; ds4_systemd_stop; return 77; }
  done < <(ds4_cgroup_hierarchies)
  if [[ $DS4_SD_CGROUP_MODE == unified ]]; then
    # Hand the v2 controllers down to user@.service (the manager enables
    # them further down itself). The hierarchy's root is exempt from the
    # no-processes-in-inner-cgroups rule; the slice holds no processes.
    # Not tested on a v2-only machine yet: test_systemd_harness.sh checks
    # that MemoryMax= arrives and skips with the reason if not.
    local c
    for c in memory pids cpu io; do
      echo "+$c" >"$DS4_SD_CGROOT/cgroup.subtree_control" 2>/dev/null || true
      echo "+$c" >"$DS4_SD_CGROOT$DS4_SD_CGROUP_TOP/cgroup.subtree_control" 2>/dev/null || true
    done
  fi

  # The manager's environment: isolated HOME and runtime dir, nothing that
  # points at the caller's own config or bus. ds4_systemd_stop restores them.
  DS4_SD_SAVED_ENV=$(declare -p HOME XDG_RUNTIME_DIR DBUS_SESSION_BUS_ADDRESS 2>/dev/null)
  export HOME=$DS4_SD_DIR/home
  export XDG_RUNTIME_DIR=$DS4_SD_DIR/run
  export DBUS_SESSION_BUS_ADDRESS=unix:path=$XDG_RUNTIME_DIR/bus
  unset XDG_CONFIG_HOME XDG_DATA_HOME XDG_STATE_HOME XDG_CACHE_HOME NOTIFY_SOCKET \
    INVOCATION_ID JOURNAL_STREAM LISTEN_FDS LISTEN_PID MANAGERPID SYSTEMD_EXEC_PID

  # Move a subshell into the new cgroups, then exec the manager from it.
  (
    while read -r h; do
      # Joining fails harmlessly where a v1 controller wants setup first
      # (cpuset: ENOSPC with empty cpuset.cpus); systemd does not use those.
      # The tracking hierarchies and memory must work.
      if ! echo "$BASHPID" >"$h$DS4_SD_CGROUP/cgroup.procs" 2>/dev/null; then
        case ${h##*/} in
          cgroup | unified | systemd | memory) echo "cannot join $h$DS4_SD_CGROUP" >"$DS4_SD_DIR/manager.log"; exit 1 ;;
        esac
      fi
    done < <(ds4_cgroup_hierarchies)
    # Without --log-target it would log to manager.log (stderr is no
    # journal stream); unit results must be in the journal.
    # SYSTEMD_GENERATOR_PATH ending in ':' puts the folder before the usual ones.
    SYSTEMD_GENERATOR_PATH=$DS4_SD_DIR/user-generators: \
      exec setsid "$DS4_SD_SYSTEMD" --user --log-target=journal </dev/null >"$DS4_SD_DIR/manager.log" 2>&1
  ) &
  DS4_SD_MANAGER_PID=$!
  export DS4_SD_MANAGER_PID

  if ! ds4_wait_until 20 ds4_manager_ready; then
    kill -0 "$DS4_SD_MANAGER_PID" 2>/dev/null || DS4_SD_MANAGER_PID=
    echo "SKIP: systemd --user did not reach 'running' within 20 s; its log:" >&2
    sed 's/^/  /' "$DS4_SD_DIR/manager.log" >&2
    ds4_systemd_stop
    return 77
  fi
  # The manager moved itself into init.scope. Its pid from there is right
  # even where setsid had to fork (a caller with job control).
  local h pid
  while read -r h; do
    pid=$(head -n1 "$h$DS4_SD_CGROUP/init.scope/cgroup.procs" 2>/dev/null)
    [[ -n $pid ]] && { DS4_SD_MANAGER_PID=$pid; break; }
  done < <(ds4_cgroup_hierarchies)
  # The user bus (dbus.socket) is what sd_bus_open_user() connects to. Start
  # the bus now and wait until the manager has joined it, so that a test's
  # first sd-bus call does not race the manager's connection.
  if ! ds4_wait_until 10 test -S "$XDG_RUNTIME_DIR/bus"; then
    echo "SKIP: the user manager has no bus socket at $XDG_RUNTIME_DIR/bus (is dbus-user-session installed?)" >&2
    ds4_systemd_stop
    return 77
  fi
  timeout 10 systemctl --user start dbus.service >/dev/null 2>&1
  if ! ds4_wait_until 10 ds4_manager_on_bus; then
    echo "SKIP: org.freedesktop.systemd1 did not appear on the user bus within 10 s" >&2
    ds4_systemd_stop
    return 77
  fi
  ds4_log "user manager $DS4_SD_MANAGER_PID up: XDG_RUNTIME_DIR=$XDG_RUNTIME_DIR cgroup=$DS4_SD_CGROUP ($DS4_SD_CGROUP_MODE)"
}

# Processes still in the manager's cgroups (any hierarchy), recursively.
ds4_cgroup_pids() {
  local h
  while read -r h; do
    [[ -d $h$DS4_SD_CGROUP ]] || continue
    find "$h$DS4_SD_CGROUP" -name cgroup.procs -exec cat {} + 2>/dev/null
  done < <(ds4_cgroup_hierarchies) | sort -u
}

ds4_cgroup_empty() { [[ -z $(ds4_cgroup_pids) ]]; }

ds4_systemd_stop() {
  [[ -n ${DS4_SD_DIR:-} ]] || return 0
  if [[ -n ${DS4_SD_MANAGER_PID:-} ]] && kill -0 "$DS4_SD_MANAGER_PID" 2>/dev/null; then
    # Orderly: the manager stops its units, then exits.
    timeout 10 systemctl --user exit >/dev/null 2>&1 || kill -TERM "$DS4_SD_MANAGER_PID" 2>/dev/null
    if ! ds4_wait_until 15 eval '! kill -0 "$DS4_SD_MANAGER_PID" 2>/dev/null'; then
      ds4_log "user manager did not exit in 15 s; killing it"
      kill -KILL "$DS4_SD_MANAGER_PID" 2>/dev/null
    fi
    wait "$DS4_SD_MANAGER_PID" 2>/dev/null
  fi
  # Anything left behind in its cgroups (KillMode=none units, a killed
  # manager) is killed: the test owns all of it.
  if [[ -n ${DS4_SD_CGROUP:-} ]]; then
    local p
    for p in $(ds4_cgroup_pids); do kill -KILL "$p" 2>/dev/null; done
    ds4_wait_until 5 ds4_cgroup_empty || ds4_log "processes left in $DS4_SD_CGROUP: $(ds4_cgroup_pids | tr '\n' ' ')"
    local h
    while read -r h; do
      [[ -d $h$DS4_SD_CGROUP_TOP ]] || continue
      # Deepest first; a cgroup is removed with rmdir, never rm -r.
      find "$h$DS4_SD_CGROUP_TOP" -depth -type d -exec rmdir {} \; 2>/dev/null
      [[ -d $h$DS4_SD_CGROUP_TOP ]] && ds4_log "could not remove $h$DS4_SD_CGROUP_TOP"
    done < <(ds4_cgroup_hierarchies)
  fi
  rm -rf "$DS4_SD_DIR"
  unset DS4_SD_DIR DS4_SD_CGROUP DS4_SD_CGROUP_TOP DS4_SD_MANAGER_PID DS4_SD_CGROUP_MODE \
    HOME XDG_RUNTIME_DIR DBUS_SESSION_BUS_ADDRESS
  if [[ -n ${DS4_SD_SAVED_ENV:-} ]]; then
    eval "${DS4_SD_SAVED_ENV//declare -/declare -g}"
    export HOME XDG_RUNTIME_DIR DBUS_SESSION_BUS_ADDRESS 2>/dev/null
  fi
  unset DS4_SD_SAVED_ENV
  return 0
}
