#!/usr/bin/env bash
# The proxy's added latency against nginx's, in one run: requests with
# max_tokens 1 at concurrency 1 and 32, (a) straight to the ds4 proxy and
# (b) through an nginx reverse proxy (Debian package, started here on loopback
# with its own config) in front of it. ds4's added latency is (a) minus the
# worker's own compute time from `timings`; nginx's is (b) minus (a).
# The worker's timings start when the request reaches the worker (it reads
# its socket between the layers of a step, and while the GPU computes one),
# so a request that comes during a step counts that wait as the worker's.
# Everything outside the worker counts as ds4's: HTTP, tokenizing, the proxy's
# queue (none here: a slot for every client), the hops to and from the worker.
# That figure also holds what is not the proxy's: the client's own wake-up and
# reads, and one hop each way. So the bench also runs (c) the engine alone: the same
# requests in the worker protocol, straight to the worker's socket, on one
# connection with ids as the proxy sends them. "ds4 added over the engine" is
# (a) minus (c): what the proxy costs over talking to the engine directly,
# measured the way nginx's figure is.
# The client is bench/http_load.c (compiled here with cc): its own cost counts
# in ds4's figure, so it is kept to microseconds. On a small shared box, run
# it with priority (`nice -n -20`) so that other work does not decide the p99.
# It also prints, per request of the direct runs, the CPU time and the
# wake-ups (voluntary context switches) of each proxy and worker thread that
# ran (busiest first): the supervisor process holds the proxy, its child the
# worker; and the same of nginx's worker process in the runs through it.
# Last, two verdict lines: the issue's goal (ds4 added at or below nginx
# added) at each concurrency and percentile, and the same with ds4's figure
# measured over the engine alone.
# Environment: DS4_BIN (build/bin), DS4_MODELS (../shared/models), DS4_DEVICE
# (the workers' device: auto, cpu, cuda), DS4_BUSY_POLL (proxy.busy_poll: auto,
# off, 100us), DS4_WORKER_BUSY_POLL (workers.busy_poll, the same), DS4_CLIENT_THREADS (the client's threads for runs (a) and (b),
# default 1: one thread works through a step's 32 answers one by one, which
# counts in ds4's figure and cancels out of nginx's), NGINX (an nginx binary, for a machine
# without the Debian package and without apt), CC (cc).
#   bench/proxy_overhead.sh [REQUESTS=2000]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-2000}
bin=${DS4_BIN:-build/bin}
model=${DS4_MODELS:-../shared/models}/stories260K.gguf
if [ -z "${NGINX:-}" ] && ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  echo "bench: installing nginx (Debian package)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx-light >/dev/null
fi
nginx=${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}
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
  busy_poll: ${DS4_BUSY_POLL:-auto}
workers:
  backend: process
  slots: 32                 # every request of the c=32 round has a slot: none waits in the proxy's queue
  device: ${DS4_DEVICE:-auto}
  busy_poll: ${DS4_WORKER_BUSY_POLL:-auto}
  threads: 1                # the client, nginx, the proxy and the worker share this box's cores; a
                            # compute pool spinning on all of them would be measured as everyone's latency
  context:
    ladder: [512]
YAML
cat >"$dir/nginx.conf" <<CONF
daemon off;
$([ "$(id -u)" = 0 ] && echo "user root root;")  # as is: the machine may have no www-data
pid $dir/nginx.pid;
error_log $dir/nginx-error.log;
worker_processes 1;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $dir/nginx-body;  # every temporary path here: /var/lib/nginx may not exist
  proxy_temp_path $dir/nginx-proxy;
  fastcgi_temp_path $dir/nginx-fastcgi;
  scgi_temp_path $dir/nginx-scgi;
  uwsgi_temp_path $dir/nginx-uwsgi;
  keepalive_requests 1000000;  # a client connection takes a round's requests (default: closed after 1000)
  upstream ds4 { server 127.0.0.1:$port_a; keepalive 64; keepalive_requests 1000000; }
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
"${CC:-cc}" -O2 -pthread -o "$dir/http_load" bench/http_load.c
printf '%s' '{"model":"stories","prompt":"Once upon a time","max_tokens":1,"temperature":0}' >"$dir/body.json"
# The same request in the worker protocol: "Once upon a time" with BOS, as the proxy tokenizes it.
printf '%s' '{"prompt":[1,403,407,261,378],"max_tokens":1,"temperature":0}' >"$dir/fields.json"
"$bin/ds4-supervisor" --config "$dir/ds4.yaml" >"$dir/sup.log" 2>&1 &
sup=$!
"$nginx" -e "$dir/nginx-error.log" -c "$dir/nginx.conf" >"$dir/nginx.log" 2>&1 &
ngx=$!
trap 'kill $sup $ngx 2>/dev/null; wait $sup $ngx 2>/dev/null; rm -rf "$dir"' EXIT
python3 bench/wait_healthy.py "$port_a" "$port_b" || { cat "$dir/sup.log" "$dir/nginx-error.log" >&2; exit 1; }
python3 - "$n" "$port_a" "$port_b" "$dir/http_load" "$dir/body.json" "$sup" "$ngx" "$dir/fields.json" \
  "unix:$XDG_RUNTIME_DIR/ds4/worker-0.sock" "${DS4_CLIENT_THREADS:-1}" <<'PY'
# bench/http_load.c drives the connections (one thread, keep-alive,
# TCP_NODELAY; a request's time runs from its send to the last byte of its
# answer). Runs (a), (b) and (c) alternate in 4 rounds so all see the same conditions.
import os, subprocess, sys
n, port_a, port_b, load, body = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
sup, ngx, fields, engine = int(sys.argv[6]), int(sys.argv[7]), sys.argv[8], sys.argv[9]
client_threads = int(sys.argv[10])
# The worker: the child that serves (a GPU worker's weights holder is another).
worker = next(int(p) for p in open(f"/proc/{sup}/task/{sup}/children").read().split()
              if b"serve" in open(f"/proc/{p}/cmdline", "rb").read().split(b"\0"))
ngx_worker = int(open(f"/proc/{ngx}/task/{ngx}/children").read().split()[0])

def threads():
    """(process, tid) -> [CPU ns, voluntary context switches] of the supervisor's, the worker's and nginx's threads."""
    out = {}
    for name, pid in (("proxy", sup), ("worker", worker), ("nginx", ngx_worker)):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                cpu = int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0])
                vol = next(int(l.split()[1]) for l in open(f"/proc/{pid}/task/{tid}/status") if l.startswith("voluntary_ctxt_switches"))
            except (OSError, StopIteration):
                continue
            out[(name, int(tid))] = [cpu, vol]
    return out

def add(total, before, after):
    for k, v in after.items():
        b = before.get(k, [0, 0])
        t = total.setdefault(k, [0, 0])
        t[0] += v[0] - b[0]
        t[1] += v[1] - b[1]

def run(port, conc, count, request=body):
    args = [load, port, str(conc), str(count), request]
    if not port.startswith("unix:"):
        args.append(str(min(conc, client_threads)))
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    rows = [tuple(map(float, line.split())) for line in out.splitlines()]
    if any(r[1] < 0 or r[2] < 0 for r in rows):
        raise SystemExit("bench: an answer without timings")
    return [r[0] for r in rows], [r[1] + r[2] for r in rows]

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]

goal = []  # (what, ds4's figure, nginx's figure)
for conc in (1, 32):
    run(port_a, conc, 4 * conc)  # warm-up
    run(port_b, conc, 4 * conc)
    run(engine, conc, 4 * conc, fields)
    la, ca, lb, cb, lc = [], [], [], [], []
    use, use_b = {}, {}
    for _ in range(4):
        before = threads()
        t, c = run(port_a, conc, n // 4)
        add(use, before, threads())
        la += t; ca += c
        before = threads()
        t, c = run(port_b, conc, n // 4)
        add(use_b, before, threads())
        lb += t; cb += c
        lc += run(engine, conc, n // 4, fields)[0]
    ds4_add = [l - c for l, c in zip(la, ca)]
    via = [l - c for l, c in zip(lb, cb)]
    for p in (50, 99):
        d = pct(ds4_add, p)
        g = pct(via, p) - d
        e = pct(la, p) - pct(lc, p)
        print(f"concurrency {conc:2d} p{p}: latency direct {pct(la, p):.3f} ms, via nginx {pct(lb, p):.3f} ms, "
              f"engine alone {pct(lc, p):.3f} ms; ds4 added {d:.3f} ms, nginx added {g:.3f} ms; "
              f"ds4 added over the engine {e:.3f} ms")
        goal.append((f"c={conc} p{p}", d, e, g))
    for proc, u in (("proxy", use), ("worker", use), ("nginx", use_b)):
        mine = sorted((v for k, v in u.items() if k[0] == proc and (v[0] > 0 or v[1] > 0)), key=lambda v: -v[0])
        cpu = sum(v[0] for v in mine) / len(la) / 1e3
        print(f"concurrency {conc:2d} {proc}: CPU {cpu:.1f} us per request; by thread (CPU us, wake-ups) "
              + " ".join(f"({v[0] / len(la) / 1e3:.1f}, {v[1] / len(la):.2f})" for v in mine))
# The issue's goal (ds4 added at or below nginx added), and the same with ds4's
# figure measured the way nginx's is (over the engine alone).
print("goal, ds4 added <= nginx added: " + "; ".join(
    f"{w} {'met' if d <= g else 'not met'} ({d:.3f} vs {g:.3f})" for w, d, e, g in goal))
print("over the engine alone <= nginx added: " + "; ".join(
    f"{w} {'yes' if e <= g else 'no'} ({e:.3f} vs {g:.3f})" for w, d, e, g in goal))
PY
