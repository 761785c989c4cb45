#!/usr/bin/env bash
# What a long prompt does to everyone else's answers: 4 clients stream answers
# (stories260K, greedy, context 131072, max_tokens_per_request 262144) while
# another sends, one after another, prompts of about 240k tokens (840 KB of
# text: short enough by its length alone to be tokenized in the proxy, then
# refused: over the context). Reports the largest pause between two chunks of
# any stream, and how long each long prompt took, for two builds (A, B: bin
# folders with ds4-supervisor and ds4-worker) in alternating rounds in one
# run, and the ratio B/A of the largest pause (median over rounds).
# Environment: DS4_MODELS (../shared/models), DS4_DEVICE (auto, cpu, cuda).
#   bench/proxy_big_prompt.sh A_BIN B_BIN [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: bench/proxy_big_prompt.sh A_BIN B_BIN [ROUNDS=3]" >&2; exit 2; }
a=$(realpath "$1")
b=$(realpath "$2")
rounds=${3:-3}
model=$(realpath "${DS4_MODELS:-../shared/models}/stories260K.gguf")
dir=$(mktemp -d /tmp/ds4-big-prompt-XXXXXX)
trap 'rm -rf "$dir"' EXIT
python3 - "$rounds" "$a" "$b" "$model" "$dir" "${DS4_DEVICE:-auto}" <<'PY'
import json, os, signal, statistics, subprocess, sys, threading, time, urllib.request

rounds, builds, model, tmp, device = int(sys.argv[1]), {"A": sys.argv[2], "B": sys.argv[3]}, sys.argv[4], sys.argv[5], sys.argv[6]
port = 18191
long_prompt = json.dumps({"prompt": "Once upon a time there was a little girl. " * 20000, "max_tokens": 1}).encode()

def serve(name):
    run = f"{tmp}/run-{name}"
    os.makedirs(run, mode=0o700, exist_ok=True)
    cfg = f"{tmp}/ds4.yaml"
    with open(cfg, "w") as f:
        f.write(f"model:\n  path: {model}\n  name: stories\nproxy:\n  listen: 127.0.0.1:{port}\n"
                f"  limits:\n    max_tokens_per_request: 262144\n"
                f"workers:\n  backend: process\n  slots: 4\n  device: {device}\n  threads: 1\n  context:\n    ladder: [131072]\n")
    env = dict(os.environ, XDG_RUNTIME_DIR=run)
    p = subprocess.Popen([f"{builds[name]}/ds4-supervisor", "--config", cfg], env=env,
                         stdout=open(f"{tmp}/sup-{name}.log", "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return p
        except Exception as e:
            if time.monotonic() > deadline or p.poll() is not None:
                p.kill()
                sys.exit(f"bench: build {name}'s supervisor did not become healthy: {e}")
            time.sleep(0.1)

def measure():
    """(largest pause between chunks of any stream in ms, each long prompt's time in ms)."""
    done = threading.Event()
    pauses = []
    lock = threading.Lock()
    def stream():
        body = json.dumps({"prompt": "Once", "max_tokens": 400, "stream": True, "temperature": 0}).encode()
        while not done.is_set():
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                last = time.monotonic()
                for _ in r:
                    now = time.monotonic()
                    with lock:
                        pauses.append(now - last)
                    last = now
    streams = [threading.Thread(target=stream) for _ in range(4)]
    for t in streams:
        t.start()
    time.sleep(0.3)
    took = []
    for _ in range(3):
        t0 = time.monotonic()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", long_prompt, {"content-type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60).read()
        except urllib.error.HTTPError as e:
            if e.code != 400:
                raise
        took.append((time.monotonic() - t0) * 1e3)
        time.sleep(0.1)
    done.set()
    for t in streams:
        t.join(timeout=60)
    return max(pauses) * 1e3, took

results = {"A": [], "B": []}
for r in range(rounds):
    for name in results:
        p = serve(name)
        try:
            results[name].append(measure())
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)
for name, rows in results.items():
    print(f"{name} ({builds[name]}): largest stream pause (ms) by round " + ", ".join(f"{m:.1f}" for m, _ in rows)
          + "; long prompts (ms) " + ", ".join("/".join(f"{x:.0f}" for x in t) for _, t in rows))
a = statistics.median(m for m, _ in results["A"])
b = statistics.median(m for m, _ in results["B"])
print(f"largest stream pause, median over rounds: B/A = {b / a:.2f}")
PY
