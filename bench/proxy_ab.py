#!/usr/bin/env python3
"""Two builds of ds4 side by side, for changes too small for one run of
bench/proxy_overhead.sh to show on a noisy machine: both supervisors serve
stories260K at once (ports 18201 and 18202, embedded process backend, the
same config as proxy_overhead.sh), and rounds of requests with max_tokens 1
alternate between them (A B, then B A, ...), so both see the same conditions.
Per round: p50/p90/p99 of the added latency (a request's time minus its
worker's timings, as proxy_overhead.sh counts it) and p50 of the whole
latency; printed: each build's median over rounds and the median of the
per-round ratios B/A.

  bench/proxy_ab.py A_BIN B_BIN [ROUNDS=10] [REQUESTS=1000] [CONCURRENCY...=1 32]

A_BIN and B_BIN are bin folders (ds4-supervisor and ds4-worker). At
concurrency c a round sends REQUESTS * (1 if c == 1 else 4) requests. Run it
with priority (`nice -n -20`) on a shared machine."""
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

here = os.path.dirname(os.path.abspath(__file__))
if len(sys.argv) < 3:
    sys.exit(__doc__)
builds = [os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 10
count = int(sys.argv[4]) if len(sys.argv) > 4 else 1000
concs = [int(x) for x in sys.argv[5:]] or [1, 32]
model = os.path.realpath(os.path.join(os.environ.get("DS4_MODELS", os.path.join(here, "../../shared/models")), "stories260K.gguf"))
for b in builds:
    if not os.access(os.path.join(b, "ds4-supervisor"), os.X_OK):
        sys.exit(f"bench: no ds4-supervisor in {b}")
if not os.path.exists(model):
    sys.exit(f"bench: {model} is missing")

d = tempfile.mkdtemp(prefix="ds4-ab-")
procs = []


def cleanup():
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
    shutil.rmtree(d, ignore_errors=True)


try:
    subprocess.run(["cc", "-O2", "-o", f"{d}/http_load", os.path.join(here, "http_load.c")], check=True)
    with open(f"{d}/body.json", "w") as f:
        f.write('{"model":"stories","prompt":"Once upon a time","max_tokens":1,"temperature":0}')
    for i, b in enumerate(builds):
        run = f"{d}/run{i}"
        os.makedirs(run, mode=0o700)
        with open(f"{d}/ds4-{i}.yaml", "w") as f:
            f.write(f"""model:
  path: {model}
  name: stories
proxy:
  listen: 127.0.0.1:{18201 + i}
workers:
  backend: process
  slots: 32
  threads: 1
  context:
    ladder: [512]
""")
        procs.append(subprocess.Popen([f"{b}/ds4-supervisor", "--config", f"{d}/ds4-{i}.yaml"],
                                      env=dict(os.environ, XDG_RUNTIME_DIR=run),
                                      stdout=open(f"{d}/sup-{i}.log", "w"), stderr=subprocess.STDOUT))
    for i in range(2):
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{18201 + i}/health", timeout=1)
                break
            except Exception:
                time.sleep(0.1)
        else:
            sys.exit(f"bench: build {'AB'[i]} did not become ready; see {d}/sup-{i}.log")

    def load(i, conc, n):
        out = subprocess.run([f"{d}/http_load", str(18201 + i), str(conc), str(n), f"{d}/body.json"],
                             check=True, capture_output=True, text=True).stdout
        rows = [tuple(map(float, line.split())) for line in out.splitlines()]
        if any(r[1] < 0 or r[2] < 0 for r in rows):
            sys.exit("bench: an answer without timings")
        return [1000 * (r[0] - r[1] - r[2]) for r in rows], [1000 * r[0] for r in rows]

    def pct(xs, p):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]

    print(f"A = {builds[0]}\nB = {builds[1]}")
    for conc in concs:
        n = count if conc == 1 else 4 * count
        load(0, conc, 4 * conc)  # warm-up
        load(1, conc, 4 * conc)
        res = ([], [])
        for r in range(rounds):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                added, lat = load(i, conc, n)
                res[i].append((pct(added, 50), pct(added, 90), pct(added, 99), pct(lat, 50)))
        for k, name in enumerate(("added p50", "added p90", "added p99", "latency p50")):
            a = [x[k] for x in res[0]]
            b = [x[k] for x in res[1]]
            ratio = statistics.median(y / x for x, y in zip(a, b))
            print(f"concurrency {conc:2d} {name:11s}: A {statistics.median(a):8.1f} us, B {statistics.median(b):8.1f} us, "
                  f"B/A per round, median {ratio:.3f}")
finally:
    cleanup()
