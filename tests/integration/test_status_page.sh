#!/usr/bin/env bash
# The status page (GET /status) in headless Chromium (tests/js/status_page.mjs,
# playwright-core on Debian's chromium): with the page open a worker is
# SIGKILLed, then an OOM kill is forced (the setup of
# test_supervisor_process_oom: a cgroup-v1 memory limit that context 2048 x 256
# slots cannot fit; `ds4ctl context 0 2048` asks for it), and the page must show
# the restart, then the OOM kill and the step down to 256, within a few
# seconds each. At 390 px wide it must not scroll sideways. Also: the page and
# /status.json refuse a request without the API key (a Basic challenge for
# browsers), and `ds4ctl status --url` reads the same JSON as the admin socket.
# Screenshots are kept under build/test-artifacts/status_page/ (printed).
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"

model=${DS4_MODELS:-$DS4_SRC/../shared/models}/stories260K.gguf
[[ -f $model ]] || { echo "SKIP: no $model"; exit 77; }
[[ -x /usr/bin/chromium ]] || { echo "SKIP: no /usr/bin/chromium (Debian's chromium package: scripts/setup.sh installs it)"; exit 77; }
command -v node >/dev/null || { echo "SKIP: no node"; exit 77; }
[[ -d $DS4_SRC/tests/js/node_modules/playwright-core ]] \
  || { echo "SKIP: tests/js/node_modules lacks playwright-core (scripts/test.sh installs it)"; exit 77; }
sup_init_memory_cgroup ds4-status-test  # the forced OOM kill needs one
artifacts=$(cd "$DS4_BIN/.." && pwd)/test-artifacts/status_page
rm -rf "$artifacts"

key=sk-status-$$
echo "$key" >"$SUP_DIR/keys"
cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $model
proxy:
  listen: 127.0.0.1:0         # any free port: tests run side by side
  api_keys_file: $SUP_DIR/keys
workers:
  backend: process
  slots: 256
  threads: 1
  context:
    ladder: [2048, 256]      # 2048 x 256 slots: 320 MiB of KV; 256: 40 MiB
  memory_max: 150MiB
  reserve: 64MiB
headroom:
  min_available: 64MiB
  step_up_after: 0
status:
  sample_every: 1s
YAML
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; sup_finish; }
sup_wait 60 'w[0]["state"] == "ready" and w[0]["context"] == 256' \
  && pass "worker ready at 256 after the OOM kill at 2048" || fail "worker not ready at 256: $(sup_status | cut -c1-400)"
url=$(sup_proxy_url)

code=$(curl -s -o /dev/null -w '%{http_code}' "$url/status")
hdr=$(curl -s -D - -o /dev/null "$url/status.json" | tr -d '\r' | grep -i '^www-authenticate:')
[[ $code == 401 && $hdr == *Basic* ]] && pass "without the key: 401 with a Basic challenge ($hdr)" \
  || fail "without the key: $code, '$hdr'"
curl -s -o "$SUP_DIR/page.html" -H "Authorization: Bearer $key" "$url/status"
grep -q 'name="viewport"' "$SUP_DIR/page.html" && ! grep -Eq '<(script|link|img)[^>]* (src|href)=' "$SUP_DIR/page.html" \
  && pass "the page: $(wc -c <"$SUP_DIR/page.html") bytes, viewport meta, no external assets" \
  || fail "the page has no viewport meta or loads something"

# ds4ctl status over HTTP: the same JSON as over the admin socket.
over_http=$(DS4_API_KEY=$key "$DS4_BIN/ds4ctl" status --url "$url" --json 2>&1)
python3 - "$over_http" "$(sup_status)" <<'PY' && pass "ds4ctl status --url reads /status.json: same workers, model and keys as the admin socket" || fail "ds4ctl status --url: $(echo "$over_http" | head -c 300)"
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert set(a) == set(b), (sorted(set(a) ^ set(b)))
assert a["model"] == b["model"]
assert [w["id"] for w in a["workers"]] == [w["id"] for w in b["workers"]]
for k in ("events", "history", "requests"): assert k in a
PY
text=$(DS4_API_KEY=$key "$DS4_BIN/ds4ctl" status --url "$url")
[[ $text == *"ID  UNIT"* && $text == *stories260K* ]] && pass "ds4ctl status --url prints the usual table" || fail "ds4ctl status --url text: $text"
"$DS4_BIN/ds4ctl" status --url "$url" >/dev/null 2>"$SUP_DIR/nokey.err" \
  && fail "ds4ctl status --url without a key answered" \
  || { grep -q 401 "$SUP_DIR/nokey.err" && pass "ds4ctl status --url without a key: $(cat "$SUP_DIR/nokey.err")" || fail "no 401 said: $(cat "$SUP_DIR/nokey.err")"; }

if (cd "$DS4_SRC/tests/js" && timeout 180 node status_page.mjs "$url" "$key" "$DS4_BIN/ds4ctl" "$artifacts"); then
  pass "the page in Chromium: the restart and the OOM step down shown, no sideways scroll on a phone"
else
  fail "the page in Chromium"
fi
[[ -f $artifacts/status-desktop.png ]] && echo "artifact: $artifacts/status-desktop.png, $artifacts/status-phone.png"

sup_stop
[[ $SUP_RC == 0 ]] && pass "SIGTERM: clean exit" || fail "supervisor exit status $SUP_RC"
sup_finish
