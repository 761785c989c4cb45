#!/usr/bin/env bash
# The memfd backing (DESIGN.md, Shared memory: Size), end to end with the
# real model, as a user runs it: the shipped ds4-supervisor.service under a
# real user manager (lib/systemd_env.sh), model.backing: memfd (what a model
# larger than /dev/shm gets with auto).
#   1. The model is served from a memfd the supervisor keeps: status and
#      journal say so, /dev/shm has no segment of it, the worker maps the
#      memfd read-only, a chat completion answers.
#   2. A SIGKILLed worker is restarted and gets the memfd from the
#      supervisor's segment socket again; requests answer.
#   3. `systemctl --user restart ds4-supervisor`: the descriptor comes back
#      from systemd's fd store, nothing is loaded again (journal), requests
#      answer. Then a crash (SIGKILL): systemd restarts the supervisor, the
#      descriptor comes back again and the running worker is adopted.
#      A reload to another model: a new memfd; the old one is released
#      (journal) and leaves the fd store.
#   4. A worker started while the supervisor is down fails at once, saying why.
#   5. Started by hand with the systemd backend: after a crash of the
#      supervisor and its keeper (the fd store by hand) the model is loaded
#      into a new memfd, and the worker on the old copy is replaced, not
#      adopted (the old copy's memory is freed).
#   6. The process backend, without systemd, with a 1 MiB /dev/shm (a private
#      mount namespace) and model.backing: auto: the supervisor takes a memfd
#      itself and says why; child workers get it; a killed one comes back.
#      `ds4-worker run --model` there loads into a memfd of its own.
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
  timeout 30 systemctl --user stop ds4-supervisor.service >/dev/null 2>&1
  sup_cleanup
  ds4_systemd_stop
}
trap cleanup EXIT
cursor=$(journalctl --show-cursor -n 0 -q 2>/dev/null | sed -n 's/^-- cursor: //p')
# journal_since CURSOR FIELD=VALUE...: the supervisor's entries since CURSOR.
journal_since() {
  local c=$1; shift
  journalctl --cursor "$c" --no-pager -q -o cat SYSLOG_IDENTIFIER=ds4-supervisor "$@" 2>/dev/null
}
new_cursor() { journalctl --show-cursor -n 0 -q 2>/dev/null | sed -n 's/^-- cursor: //p'; }
# Entries reach the journal asynchronously: wait until one matches.
journal_wait() {  # SECONDS CURSOR FIELD=VALUE...
  local t=$1 c=$2; shift 2
  ds4_wait_until "$t" eval '[[ -n $(journal_since "$c" '"$*"') ]]'
}

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url=http://127.0.0.1:$port
write_config() {  # FILE BACKEND [BACKING]
  cat >"$1" <<YAML
model:
  path: $model
  backing: ${3:-memfd}
proxy:
  listen: 127.0.0.1:$port
workers:
  backend: $2
  device: cpu
  slots: 2
  threads: 1
  context:
    ladder: [512]
  reserve: 16MiB
headroom:
  min_available: 16MiB
  step_up_after: 0
restart:
  backoff_initial: 200ms
  backoff_max: 800ms
YAML
}

# chat_ok: a chat completion answers with text.
chat_ok() {
  local body
  body=$(curl -s --max-time 30 "$url/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"messages":[{"role":"user","content":"Once upon a time"}],"max_tokens":12,"temperature":0}')
  python3 -c 'import json,sys; c=json.loads(sys.argv[1])["choices"][0]["message"]["content"]; sys.exit(0 if c.strip() else 1)' "$body" 2>/dev/null \
    && { chat_text=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["choices"][0]["message"]["content"][:60])' "$body"); return 0; }
  chat_text=$body
  return 1
}

# --- install: the shipped unit, binaries linked into ~/.local/bin ---
mkdir -p "$HOME/.local/bin" "$HOME/.local/share/systemd/user" "$HOME/.config/ds4"
for b in ds4-supervisor ds4-worker ds4ctl ds4-mkmodel; do ln -sf "$DS4_BIN/$b" "$HOME/.local/bin/$b"; done
cp "$DS4_SRC/systemd/ds4-supervisor.service" "$HOME/.local/share/systemd/user/"
write_config "$HOME/.config/ds4/ds4.yaml" systemd
systemctl --user daemon-reload
max=$(systemctl --user show -P FileDescriptorStoreMax ds4-supervisor.service)
((max > 0)) && pass "the shipped unit keeps descriptors (FileDescriptorStoreMax=$max)" || fail "FileDescriptorStoreMax=$max"

# --- 1. served from a memfd ---
# Named segments already there (other tests of this model leave theirs until
# a supervisor sweeps them): device:inode of each, to tell them from new ones.
shm_before=$(stat -c '%d:%i' /dev/shm/ds4-model-* 2>/dev/null | sort)
if timeout 60 systemctl --user start ds4-supervisor.service; then
  pass "ds4-supervisor.service started"
else
  fail "ds4-supervisor.service did not start"
  journalctl --no-pager -q -n 30 --user-unit ds4-supervisor.service
  sup_finish
fi
sup_wait 30 'w[0]["state"] == "ready"' && pass "worker ready" || fail "worker not ready: $(sup_status | tr -d '\n' | cut -c1-400)"
segment=$(sup_get 's["model"]["segment"]')
backing=$(sup_get 's["model"]["backing"]')
[[ $segment == memfd:ds4-model-* ]] && pass "status: segment $segment" || fail "status: segment '$segment'"
[[ $backing == "memfd (in the supervisor, fd store)" ]] && pass "status: backing '$backing'" || fail "status: backing '$backing'"
"$DS4_BIN/ds4ctl" status | grep -q "in memfd (in the supervisor, fd store)" && pass "ds4ctl status says where the model is" \
  || fail "ds4ctl status: $("$DS4_BIN/ds4ctl" status | head -1)"
name=${segment#memfd:}
shm_new=$(comm -13 <(echo "$shm_before") <(stat -c '%d:%i' /dev/shm/ds4-model-* 2>/dev/null | sort))
[[ -z $shm_new ]] && pass "no new /dev/shm/ds4-model-* segment was made" || fail "new named segment(s): $shm_new"
journal_wait 10 "$cursor" DS4_EVENT=segment_memfd && pass "journal: $(journal_since "$cursor" DS4_EVENT=segment_memfd | head -1 | cut -c1-140)..." \
  || fail "no DS4_EVENT=segment_memfd entry"
journal_wait 10 "$cursor" DS4_EVENT=fdstore_stored && pass "journal: $(journal_since "$cursor" DS4_EVENT=fdstore_stored | head -1)" \
  || fail "no DS4_EVENT=fdstore_stored entry"
wpid=$(sup_get 'w[0]["pid"]')
sup_pid=$(systemctl --user show -P MainPID ds4-supervisor.service)
! grep -qs "/dev/shm/ds4-model-" "/proc/$sup_pid/maps" "/proc/$wpid/maps" 2>/dev/null \
  && pass "neither the supervisor nor its worker maps a /dev/shm segment" || fail "a /dev/shm segment is mapped"
maps=$(grep "/memfd:$name " "/proc/$wpid/maps" 2>/dev/null | head -1)
[[ $maps == *" r--s "* ]] && pass "worker $wpid maps the memfd read-only: ${maps:0:100}" || fail "worker maps: '$maps'"
chat_ok && pass "chat completion: '$chat_text'" || fail "chat completion: $chat_text"

# --- 2. a killed worker comes back on the same memfd ---
kill -KILL "$wpid"
if sup_wait 30 'w[0]["state"] == "ready" and w[0]["pid"] not in (0, '"$wpid"')'; then
  wpid=$(sup_get 'w[0]["pid"]')
  pass "SIGKILLed worker restarted (pid $wpid)"
else
  fail "worker not back after SIGKILL: $(sup_status | tr -d '\n' | cut -c1-400)"
fi
grep -q "/memfd:$name " "/proc/$wpid/maps" 2>/dev/null && pass "the restarted worker maps the same memfd" || fail "restarted worker does not map /memfd:$name"
chat_ok && pass "chat completion after the restart: '$chat_text'" || fail "chat completion after the restart: $chat_text"

# --- 3. the supervisor restarts: the weights come back from the fd store ---
c3=$(new_cursor)
sup_pid=$(systemctl --user show -P MainPID ds4-supervisor.service)
if timeout 60 systemctl --user restart ds4-supervisor.service; then
  pass "systemctl --user restart ds4-supervisor"
else
  fail "restart failed"
fi
new_pid=$(systemctl --user show -P MainPID ds4-supervisor.service)
[[ $new_pid != "$sup_pid" && $new_pid != 0 ]] && pass "a new supervisor process ($sup_pid -> $new_pid)" || fail "MainPID $sup_pid -> $new_pid"
sup_wait 30 'w[0]["state"] == "ready"' || fail "not ready after the restart"
journal_wait 10 "$c3" DS4_EVENT=fdstore_recovered && pass "journal: $(journal_since "$c3" DS4_EVENT=fdstore_recovered | head -1)" \
  || fail "no DS4_EVENT=fdstore_recovered entry after the restart"
journal_wait 10 "$c3" DS4_EVENT=segment_reused && pass "journal: $(journal_since "$c3" DS4_EVENT=segment_reused | head -1)" \
  || fail "no DS4_EVENT=segment_reused entry after the restart"
[[ -z $(journal_since "$c3" DS4_EVENT=segment_memfd) ]] && pass "nothing was loaded again (no segment_memfd entry)" \
  || fail "the model was loaded again: $(journal_since "$c3" DS4_EVENT=segment_memfd | head -1)"
[[ $(sup_get 's["model"]["segment"]') == "$segment" && $(sup_get 's["model"]["reused"]') == True ]] \
  && pass "status: the same segment, reused" || fail "status: segment $(sup_get 's["model"]["segment"]') reused $(sup_get 's["model"]["reused"]')"
chat_ok && pass "chat completion after the supervisor restart: '$chat_text'" || fail "chat completion after the supervisor restart: $chat_text"

# A crash (SIGKILL): systemd restarts it (Restart=on-failure), the weights
# come back from the fd store again, and the running worker is adopted.
c3=$(new_cursor)
sup_pid=$(systemctl --user show -P MainPID ds4-supervisor.service)
wpid=$(sup_get 'w[0]["pid"]')
kill -KILL "$sup_pid"
back() { local p; p=$(systemctl --user show -P MainPID ds4-supervisor.service); [[ $p != 0 && $p != "$sup_pid" ]] && [[ $(systemctl --user is-active ds4-supervisor.service) == active ]]; }
ds4_wait_until 30 back && pass "systemd restarted the killed supervisor" || fail "supervisor not restarted after SIGKILL"
sup_wait 30 'w[0]["state"] == "ready"' || fail "not ready after the crash"
journal_wait 10 "$c3" DS4_EVENT=segment_reused && pass "after the crash: the memfd reused from the fd store" || fail "no segment_reused entry after the crash"
[[ -z $(journal_since "$c3" DS4_EVENT=segment_memfd) ]] && pass "after the crash: nothing loaded again" || fail "loaded again after the crash"
[[ $(sup_get 'w[0]["pid"]') == "$wpid" ]] && pass "the running worker was adopted (pid $wpid)" || fail "worker pid $(sup_get 'w[0]["pid"]'), was $wpid"
chat_ok && pass "chat completion after the crash: '$chat_text'" || fail "chat completion after the crash: $chat_text"
# A killed worker gets the descriptor from the new supervisor too.
kill -KILL "$wpid"
sup_wait 30 'w[0]["state"] == "ready" and w[0]["pid"] not in (0, '"$wpid"')' && chat_ok \
  && pass "a worker started by the new supervisor serves: '$chat_text'" || fail "worker after the supervisor restart: $chat_text"

# Another model (a copy of the file: another identity): loaded into a new
# memfd while the old one serves; the old one is let go (and removed from the
# fd store) once no worker maps it, so a restart gets only the new one back.
cp "$model" "$SUP_DIR/copy.gguf"
sed -i "s|^  path: .*|  path: $SUP_DIR/copy.gguf|" "$HOME/.config/ds4/ds4.yaml"
c4=$(new_cursor)
"$DS4_BIN/ds4ctl" reload >/dev/null || fail "ds4ctl reload"
sup_wait 30 's["model"]["segment"] != "'"$segment"'" and w[0]["state"] == "ready"' || fail "the new model is not served"
segment2=$(sup_get 's["model"]["segment"]')
[[ $segment2 == memfd:ds4-model-* ]] && pass "reload: the new model is served from $segment2" || fail "reload: segment $segment2"
if journal_wait 20 "$c4" DS4_EVENT=segment_removed DS4_SEGMENT="$segment"; then
  pass "journal: $(journal_since "$c4" DS4_EVENT=segment_removed DS4_SEGMENT="$segment" | head -1)"
else
  fail "the old memfd segment $segment was not released"
fi
chat_ok && pass "chat completion on the new model: '$chat_text'" || fail "chat completion on the new model: $chat_text"
c5=$(new_cursor)
timeout 60 systemctl --user restart ds4-supervisor.service || fail "restart after the reload"
sup_wait 30 'w[0]["state"] == "ready"' || fail "not ready after the restart"
journal_wait 10 "$c5" DS4_EVENT=segment_reused || fail "no segment_reused after the reload's restart"
recovered=$(journal_since "$c5" DS4_EVENT=fdstore_recovered | wc -l)
[[ $recovered == 1 && -n $(journal_since "$c5" DS4_EVENT=fdstore_recovered DS4_SEGMENT="$segment2") ]] \
  && pass "the fd store gave back only the new segment" || fail "fd store gave back $recovered: $(journal_since "$c5" DS4_EVENT=fdstore_recovered | tr '\n' ' ')"
segment=$segment2

# An installed unit without FileDescriptorStoreMax= (an older one): status
# does not claim the fd store, and the journal says what to do.
mkdir -p "$HOME/.config/systemd/user/ds4-supervisor.service.d"
printf '[Service]\nFileDescriptorStoreMax=0\n' >"$HOME/.config/systemd/user/ds4-supervisor.service.d/50-nostore.conf"
systemctl --user daemon-reload
c6=$(new_cursor)
timeout 60 systemctl --user restart ds4-supervisor.service || fail "restart without an fd store"
sup_wait 30 'w[0]["state"] == "ready"' || fail "not ready without an fd store"
[[ $(sup_get 's["model"]["backing"]') == "memfd (in the supervisor)" ]] && pass "FileDescriptorStoreMax=0: backing '$(sup_get 's["model"]["backing"]')'" \
  || fail "FileDescriptorStoreMax=0: backing '$(sup_get 's["model"]["backing"]')'"
journal_wait 10 "$c6" PRIORITY=4 && journal_since "$c6" PRIORITY=4 | grep -q "FileDescriptorStoreMax=0" \
  && pass "journal: $(journal_since "$c6" PRIORITY=4 | grep -m1 FileDescriptorStoreMax=0 | cut -c1-120)..." || fail "no warning about FileDescriptorStoreMax=0"
chat_ok && pass "chat completion without an fd store: '$chat_text'" || fail "chat completion without an fd store: $chat_text"
rm -r "$HOME/.config/systemd/user/ds4-supervisor.service.d"
systemctl --user daemon-reload
segment=$(sup_get 's["model"]["segment"]')

# --- 4. no supervisor: a worker fails at once, saying why ---
timeout 60 systemctl --user stop ds4-supervisor.service
t0=${EPOCHREALTIME/[.,]/}
out=$(timeout 30 "$DS4_BIN/ds4-worker" serve --segment "$segment" --socket "$SUP_DIR/w.sock" --threads 1 2>&1)
rc=$?
ms=$(((${EPOCHREALTIME/[.,]/} - t0) / 1000))
[[ $rc != 0 && $rc != 124 && $out == *"is ds4-supervisor running?"* ]] \
  && pass "worker without a supervisor: exit $rc in $ms ms: ${out:0:160}..." || fail "worker without a supervisor: rc $rc: $out"

# --- 5. by hand, systemd backend: a crash of the keeper too loads a new copy ---
# SIGKILL of $SUP_PID, the keeper, ends its supervisor and its fd store: the
# new supervisor cannot get the old memfd back: it loads the model into
# a new one, and the worker still running on the old copy is replaced, not
# adopted, so that the old copy's memory is freed.
write_config "$SUP_DIR/byhand.yaml" systemd memfd
sup_start "$SUP_DIR/byhand.yaml" || fail "the supervisor (by hand) did not start"
if sup_wait 30 'w[0]["state"] == "ready"'; then
  old=$(sup_get 's["model"]["segment"]')
  wpid=$(sup_get 'w[0]["pid"]')
  kill -KILL "$SUP_PID"; wait "$SUP_PID" 2>/dev/null; SUP_PID=
  sup_start "$SUP_DIR/byhand.yaml" || fail "the supervisor (by hand) did not come back"
  sup_wait 30 'w[0]["state"] == "ready" and w[0]["pid"] != '"$wpid" || fail "no worker after the crash"
  new=$(sup_get 's["model"]["segment"]')
  [[ $new != "$old" && $new == memfd:* ]] && pass "by hand: loaded again into a new memfd ($old -> $new)" || fail "by hand: segment $old -> $new"
  gone() { ! kill -0 "$wpid" 2>/dev/null; }
  ds4_wait_until 10 gone && pass "the worker on the old copy was replaced, not adopted" || fail "worker $wpid on the old copy still runs"
  unmapped() { ! grep -qs "/memfd:${old#memfd:} " /proc/[0-9]*/maps; }
  ds4_wait_until 10 unmapped && pass "no process maps the old copy: its memory is freed" || fail "the old copy is still mapped"
  chat_ok && pass "by hand: chat completion after the crash: '$chat_text'" || fail "by hand: chat completion: $chat_text"
else
  fail "by hand: worker not ready: $(sup_status | tr -d '\n' | cut -c1-400)"
fi
sup_stop

# --- 6. the process backend, without systemd, in a container-like /dev/shm ---
# A private mount namespace whose /dev/shm (1 MiB) cannot hold the model
# (1.2 MiB): with model.backing: auto the supervisor takes a memfd itself.
write_config "$SUP_DIR/process.yaml" process auto
if unshare -m --propagation private true 2>/dev/null; then
  unshare -m --propagation private sh -c \
    'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$0" --config "$1"' \
    "$DS4_BIN/ds4-supervisor" "$SUP_DIR/process.yaml" >>"$SUP_DIR/sup.log" 2>&1 &
  SUP_PID=$!
  if sup_wait 30 'w[0]["state"] == "ready"'; then
    [[ $(sup_get 's["model"]["backing"]') == "memfd (in the supervisor, its keeper's fd store)" ]] \
      && pass "a 1 MiB /dev/shm, model.backing auto: backing '$(sup_get 's["model"]["backing"]')'" \
      || fail "process backend: backing '$(sup_get 's["model"]["backing"]')'"
    grep -q "loaded into memfd segment .*: /dev/shm cannot hold it" "$SUP_DIR/sup.log" \
      && pass "the log says why: $(grep -o '/dev/shm cannot hold it.*has [^;]*' "$SUP_DIR/sup.log" | head -1)" \
      || fail "no reason for the memfd in the log"
    chat_ok && pass "process backend: chat completion '$chat_text'" || fail "process backend: chat completion: $chat_text"
    wpid=$(sup_get 'w[0]["pid"]')
    kill -KILL "$wpid"
    sup_wait 30 'w[0]["state"] == "ready" and w[0]["pid"] not in (0, '"$wpid"')' && chat_ok \
      && pass "process backend: a killed worker comes back and serves" || fail "process backend: worker after SIGKILL: $chat_text"
  else
    fail "process backend: worker not ready: $(sup_status | tr -d '\n' | cut -c1-400)"
  fi
  sup_stop
  [[ ${SUP_RC:-1} == 0 ]] && pass "process backend: clean exit" || fail "process backend: exit status ${SUP_RC:-?}"
  # One-shot generation without the daemons, in the same small /dev/shm.
  out=$(unshare -m --propagation private sh -c 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$0" run --model "$1" -p "Once upon a time" -n 8 --temp 0 --threads 1 --json' \
    "$DS4_BIN/ds4-worker" "$model" 2>/dev/null)
  python3 -c 'import json,sys; d=json.loads(sys.argv[1]); sys.exit(0 if len(d["tokens"]) == 8 else 1)' "$out" 2>/dev/null \
    && pass "ds4-worker run in a 1 MiB /dev/shm: $(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["text"][:50])' "$out")" \
    || fail "ds4-worker run in a 1 MiB /dev/shm: $out"
else
  echo "note - no private mount namespace here (unshare -m): the container-like /dev/shm case is not run"
fi
sup_finish
