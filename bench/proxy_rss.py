#!/usr/bin/env python3
"""The supervisor's resident memory after large requests, for one or two
builds in one run: each serves stories260K (embedded process backend) while
ten clients at once send chat requests of about 14.5 MB (330,000 messages,
under the 16 MiB body limit), twice; then its VmRSS, two seconds later. The
supervisor shares the machine's memory with the workers whose headroom it
watches, so what it keeps after a burst counts.

  bench/proxy_rss.py BIN [BIN_B]   (bin folders holding ds4-supervisor and ds4-worker)"""
import json, os, subprocess, sys, tempfile, threading, time, urllib.request

here = os.path.dirname(os.path.abspath(__file__))
model = os.path.join(os.environ.get("DS4_MODELS", os.path.join(here, "..", "..", "shared", "models")), "stories260K.gguf")
if len(sys.argv) < 2:
    sys.exit(__doc__)


def measure(bin_dir, port):
    d = tempfile.mkdtemp(prefix="ds4-rss-")
    run = f"{d}/run"
    os.makedirs(run, mode=0o700)
    with open(f"{d}/c.yaml", "w") as f:
        f.write(f"model:\n  path: {os.path.abspath(model)}\nproxy:\n  listen: 127.0.0.1:{port}\n"
                "workers:\n  backend: process\n  context:\n    ladder: [512]\n")
    p = subprocess.Popen([f"{bin_dir}/ds4-supervisor", "--config", f"{d}/c.yaml"],
                         env=dict(os.environ, XDG_RUNTIME_DIR=run), stdout=open(f"{d}/log", "w"), stderr=subprocess.STDOUT)
    try:
        def rss_mib():
            with open(f"/proc/{p.pid}/status") as f:
                return int(next(l.split()[1] for l in f if l.startswith("VmRSS"))) // 1024
        deadline = time.monotonic() + 60
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                    break
            except Exception:
                if time.monotonic() > deadline:
                    raise SystemExit(f"bench: {bin_dir}: the supervisor did not become ready (log: {d}/log)")
                time.sleep(0.1)
        body = json.dumps({"messages": [{"role": "user", "content": "hello there"}] * 330000, "max_tokens": 1}).encode()
        before = rss_mib()

        def send():
            try:
                urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body),
                                       timeout=120).read()
            except Exception:
                pass  # the answer (400: the prompt is over the context) does not matter here
        for _ in range(2):
            clients = [threading.Thread(target=send) for _ in range(10)]
            for t in clients:
                t.start()
            for t in clients:
                t.join()
        time.sleep(2)
        return before, rss_mib(), len(body)
    finally:
        p.terminate()
        p.wait()


results = [measure(b, 18611 + i) for i, b in enumerate(sys.argv[1:3])]
for b, (before, after, size) in zip(sys.argv[1:3], results):
    print(f"{b}: supervisor RSS {before} MiB at start, {after} MiB after 2 x 10 requests of {size / 1e6:.1f} MB")
if len(results) == 2:
    print(f"after the requests, B/A: {results[1][1] / max(results[0][1], 1):.2f}")
