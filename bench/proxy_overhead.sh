#!/usr/bin/env bash
# The proxy's added latency against nginx's, in one run: requests with
# max_tokens 1 at concurrency 1 and 32, (a) straight to the ds4 proxy and
# (b) through an nginx reverse proxy (Debian package, started here on loopback
# with its own config) in front of it. ds4's added latency is (a) minus the
# worker's own compute time from `timings`; nginx's is (b) minus (a).
#   bench/proxy_overhead.sh [REQUESTS=400]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-400}
bin=${DS4_BIN:-build/bin}
model=${DS4_MODELS:-../shared/models}/stories260K.gguf
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  echo "bench: installing nginx (Debian package)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx-light >/dev/null
fi
nginx=$(command -v nginx || echo /usr/sbin/nginx)
dir=$(mktemp -d /tmp/ds4-overhead-XXXXXX)
export XDG_RUNTIME_DIR=$dir/run
mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"
port_a=18181
port_b=18182
cat >"$dir/ds4.yaml" <<YAML
model:
  path: $(realpath "$model")
  name: stories
proxy:
  listen: 127.0.0.1:$port_a
workers:
  backend: process
  slots: 32
  context:
    ladder: [512]
YAML
cat >"$dir/nginx.conf" <<CONF
daemon off;
pid $dir/nginx.pid;
error_log $dir/nginx-error.log;
worker_processes 1;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $dir/nginx-body;
  proxy_temp_path $dir/nginx-proxy;
  upstream ds4 { server 127.0.0.1:$port_a; keepalive 64; }
  server {
    listen 127.0.0.1:$port_b;
    location / {
      proxy_pass http://ds4;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
CONF
"$bin/ds4-supervisor" --config "$dir/ds4.yaml" >"$dir/sup.log" 2>&1 &
sup=$!
"$nginx" -c "$dir/nginx.conf" >"$dir/nginx.log" 2>&1 &
ngx=$!
trap 'kill $sup $ngx 2>/dev/null; wait $sup $ngx 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$port_a/health" >/dev/null && curl -sf "http://127.0.0.1:$port_b/health" >/dev/null && break
  sleep 0.1
done
python3 - "$n" "$port_a" "$port_b" <<'PY'
import http.client, json, statistics, sys, threading, time
n, port_a, port_b = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
body = json.dumps({"model": "stories", "prompt": "Once upon a time", "max_tokens": 1, "temperature": 0})

def run(port, conc):
    lat, comp = [], []
    lock = threading.Lock()
    per = n // conc
    def client():
        c = http.client.HTTPConnection("127.0.0.1", port)
        for _ in range(per):
            t0 = time.perf_counter()
            c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = c.getresponse()
            data = r.read()
            dt = (time.perf_counter() - t0) * 1000
            t = json.loads(data)["timings"]
            with lock:
                lat.append(dt)
                comp.append(t["prompt_ms"] + t["predicted_ms"])
    ts = [threading.Thread(target=client) for _ in range(conc)]
    for t in ts: t.start()
    for t in ts: t.join()
    return lat, comp

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]

for conc in (1, 32):
    run(port_a, conc)  # warm-up
    la, ca = run(port_a, conc)
    lb, cb = run(port_b, conc)
    ds4_add = [l - c for l, c in zip(la, ca)]
    via = [l - c for l, c in zip(lb, cb)]
    for p in (50, 99):
        d = pct(ds4_add, p)
        g = pct(via, p) - d
        print(f"concurrency {conc:2d} p{p}: latency direct {pct(la, p):.2f} ms, via nginx {pct(lb, p):.2f} ms; "
              f"ds4 added {d:.2f} ms, nginx added {g:.2f} ms")
PY
