#!/usr/bin/env bash
# What a long prompt does to everyone else's answers: 4 clients stream answers
# (stories260K, greedy) while another sends, one after another, prompts of
# about 100k tokens (430 KB of text; each is tokenized in the proxy, then
# refused: over the context). Reports the largest pause between two chunks of
# any stream, and how long each long prompt took, for proxy.threads 1 (one
# thread serves the connections and runs the queue) and proxy.threads N
# (connections on N threads of their own), in alternating rounds in one run;
# and their ratio.
# Environment: DS4_BIN (build/bin), DS4_MODELS (../shared/models), DS4_DEVICE
# (auto, cpu, cuda), DS4_PROXY_THREADS (N, default 4).
#   bench/proxy_big_prompt.sh [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
bin=$(realpath "${DS4_BIN:-build/bin}")
model=$(realpath "${DS4_MODELS:-../shared/models}/stories260K.gguf")
dir=$(mktemp -d /tmp/ds4-big-prompt-XXXXXX)
trap 'rm -rf "$dir"' EXIT
python3 - "$rounds" "$bin" "$model" "$dir" "${DS4_PROXY_THREADS:-4}" "${DS4_DEVICE:-auto}" <<'PY'
import json, os, signal, statistics, subprocess, sys, threading, time, urllib.request

rounds, bin_dir, model, tmp, threads, device = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
port = 18191
long_prompt = json.dumps({"prompt": "Once upon a time there was a little girl. " * 10000, "max_tokens": 1}).encode()

def serve(n_threads):
    run = f"{tmp}/run-{n_threads}"
    os.makedirs(run, mode=0o700, exist_ok=True)
    cfg = f"{tmp}/ds4-{n_threads}.yaml"
    with open(cfg, "w") as f:
        f.write(f"model:\n  path: {model}\n  name: stories\nproxy:\n  listen: 127.0.0.1:{port}\n  threads: {n_threads}\n"
                f"workers:\n  backend: process\n  slots: 8\n  device: {device}\n  threads: 1\n  context:\n    ladder: [512]\n")
    env = dict(os.environ, XDG_RUNTIME_DIR=run)
    p = subprocess.Popen([f"{bin_dir}/ds4-supervisor", "--config", cfg], env=env,
                         stdout=open(f"{tmp}/sup-{n_threads}.log", "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return p
        except Exception as e:
            if time.monotonic() > deadline or p.poll() is not None:
                p.kill()
                sys.exit(f"bench: the supervisor did not become healthy: {e}; see {tmp}/sup-{n_threads}.log")
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

results = {1: [], threads: []} if threads != "1" else {1: []}
for r in range(rounds):
    for n in results:
        p = serve(n)
        try:
            results[n].append(measure())
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)
for n, rows in results.items():
    print(f"proxy.threads {n}: largest stream pause (ms) by round " + ", ".join(f"{m:.1f}" for m, _ in rows)
          + "; long prompt (ms) " + ", ".join("/".join(f"{x:.0f}" for x in t) for _, t in rows))
if len(results) == 2:
    a = statistics.median(m for m, _ in results[1])
    b = statistics.median(m for m, _ in results[threads])
    print(f"largest pause, median over rounds: threads {threads} / threads 1 = {b / a:.2f}")
PY
