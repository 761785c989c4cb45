#!/usr/bin/env bash
# docs/grafana/ds4.json (the Grafana dashboard) and docs/grafana/prometheus.yml
# (the scrape config) against a live /metrics: every metric a panel's query
# names is one the supervisor really exports (after a request, so that the
# counters have samples), each panel is well formed, and the scrape config
# scrapes /metrics. The checker is first shown a query with a made-up metric,
# which it must reject. Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"

python3 -c 'import yaml' 2>/dev/null || { echo "SKIP: python3-yaml is needed to read prometheus.yml"; exit 77; }
sup_begin

cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $model
proxy:
  listen: 127.0.0.1:0         # any free port: tests run side by side
workers:
  backend: process
  threads: 1
  context:
    ladder: [256, 128]
YAML
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; sup_finish; }
sup_wait 60 'w[0]["state"] == "ready"' && pass "worker ready" || fail "worker not ready"
url=$(sup_proxy_url)
[[ $(sup_complete "$url" stories260K | tail -1) == 200 ]] && pass "one completion answered" || fail "the completion"
curl -s -o /dev/null "$url/v1/no-such-path"   # an error, so that the error counters have samples too
curl -s --max-time 10 "$url/metrics" >"$SUP_DIR/metrics.txt"

python3 - "$DS4_SRC/docs/grafana/ds4.json" "$DS4_SRC/docs/grafana/prometheus.yml" "$SUP_DIR/metrics.txt" <<'PY'
import json, re, sys, yaml
dash_file, prom_file, metrics_file = sys.argv[1:4]
fails = 0
def check(ok, what):
    global fails
    print(("ok   - " if ok else "FAIL - ") + what)
    fails += not ok

# A name counts when /metrics has samples of it or declares it (# TYPE: a
# labelled counter such as ds4_http_errors_total has no sample before its
# first error; a histogram's or summary's series are NAME_bucket, _sum, _count).
exported = set()
for line in open(metrics_file):
    m = re.match(r"# TYPE (\S+) (\S+)", line)
    if m:
        exported.add(m.group(1))
        if m.group(2) in ("histogram", "summary"):
            exported |= {m.group(1) + s for s in ("_bucket", "_sum", "_count")}
    if line.startswith("#") or not line.strip(): continue
    exported.add(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0))
check(len(exported) > 20, f"/metrics exports {len(exported)} series names")

def unknown(expr):
    return sorted(set(re.findall(r"\bds4_[a-z0-9_]+", expr)) - exported)
# The checker must be able to fail.
check(unknown("rate(ds4_made_up_total[5m])") == ["ds4_made_up_total"], "the checker rejects a made-up metric")

dash = json.load(open(dash_file))
panels = [p for p in dash["panels"] if p["type"] != "row"]
check(len(panels) >= 10, f"{len(panels)} panels")
ids = [p["id"] for p in dash["panels"]]
check(len(ids) == len(set(ids)), "panel ids are unique")
names = set()
for p in panels:
    g = p.get("gridPos", {})
    check(all(k in g for k in "xywh") and g["x"] + g["w"] <= 24, f"panel '{p['title']}': grid position {g}")
    check(bool(p.get("targets")), f"panel '{p['title']}': has queries")
    for t in p.get("targets", []):
        bad = unknown(t["expr"])
        names |= set(re.findall(r"\bds4_[a-z0-9_]+", t["expr"]))
        check(not bad, f"panel '{p['title']}': {t['expr'][:90]}" + (f" names {bad}, not in /metrics" if bad else ""))
for want in ["ds4_worker_state", "ds4_worker_context", "ds4_worker_in_flight", "ds4_worker_restarts_total",
             "ds4_worker_oom_kills_total", "ds4_worker_uptime_seconds", "ds4_model_bytes", "ds4_headroom",
             "ds4_queue_waiting", "ds4_generated_tokens_total", "ds4_request_duration_seconds_bucket",
             "ds4_worker_decisions_total"]:
    check(want in names, f"a panel shows {want} (as the status page does)")
var = dash["templating"]["list"][0]
check(not unknown(var["definition"]), f"the instance variable's query: {var['definition']}")

prom = yaml.safe_load(open(prom_file))
jobs = [j for j in prom["scrape_configs"] if j["job_name"] == "ds4"]
check(len(jobs) == 1 and jobs[0].get("metrics_path", "/metrics") == "/metrics" and jobs[0]["static_configs"][0]["targets"],
      "prometheus.yml scrapes /metrics of a ds4 target")
sys.exit(1 if fails else 0)
PY
(($? == 0)) && pass "the dashboard's metrics are /metrics's" || fail "the dashboard against /metrics"
sup_stop
sup_finish
