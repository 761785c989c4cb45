#!/usr/bin/env bash
# Long prompts where agents live (issue 25), through the whole service:
# stories260K, the supervisor with its process backend, 3 slots of 20480
# tokens, greedy. For each workers.prefill_chunk given (in alternating rounds):
#   - cold: time to the first token of a 16384-token prompt (token ids);
#   - warm: the same prompt plus 16 tokens (an agent's next turn), served
#     from the slot that holds the prefix: its time to first token, and the
#     ratio warm / cold (the goal: at most 5%), and the cache_n it reported;
#   - stall: two streams generating while another 16384-token prompt arrives:
#     the largest gap between two of their tokens during that prefill,
#     against the largest gap without it.
#   bench/long_prompt.sh [CHUNKS="256 64"] [ROUNDS=2]
# Environment: DS4_BIN (build/bin), DS4_MODELS (../shared/models), DS4_THREADS (2).
set -euo pipefail
cd "$(dirname "$0")/.."
chunks=${1:-256 64}
rounds=${2:-2}
bin=$(realpath "${DS4_BIN:-build/bin}")
model=$(realpath "${DS4_MODELS:-../shared/models}/stories260K.gguf")
dir=$(mktemp -d /tmp/ds4-long-prompt-XXXXXX)
trap 'rm -rf "$dir"' EXIT
echo "load before: $(uptime)"
python3 - "$bin" "$model" "$dir" "$rounds" "${DS4_THREADS:-2}" $chunks <<'PY'
import json, os, random, signal, statistics, subprocess, sys, threading, time, urllib.request

bin_dir, model, tmp, rounds, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
chunks = [int(c) for c in sys.argv[6:]]
port = 18291
N = 16384
rng = random.Random(7)
prefix = [rng.randrange(10, 500) for _ in range(N)]
turn = prefix + [rng.randrange(10, 500) for _ in range(16)]
other = [rng.randrange(10, 500) for _ in range(N)]

def serve(chunk):
    run = f"{tmp}/run-{chunk}"
    os.makedirs(run, mode=0o700, exist_ok=True)
    cfg = f"{tmp}/ds4-{chunk}.yaml"
    with open(cfg, "w") as f:
        f.write(f"model:\n  path: {model}\n  name: stories\nproxy:\n  listen: 127.0.0.1:{port}\n"
                f"  limits:\n    max_tokens_per_request: 32768\n"
                f"workers:\n  backend: process\n  slots: 3\n  device: cpu\n  threads: {threads}\n"
                f"  prefill_chunk: {chunk}\n  context:\n    ladder: [20480]\n  reserve: 64MiB\n"
                f"headroom:\n  min_available: 64MiB\n")
    env = dict(os.environ, XDG_RUNTIME_DIR=run)
    p = subprocess.Popen([f"{bin_dir}/ds4-supervisor", "--config", cfg], env=env,
                         stdout=open(f"{tmp}/sup-{chunk}.log", "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return p
        except Exception as e:
            if time.monotonic() > deadline or p.poll() is not None:
                p.kill()
                sys.exit(f"bench: the supervisor (prefill_chunk {chunk}) did not become healthy: {e}; see {tmp}/sup-{chunk}.log")
            time.sleep(0.1)

def stream(body, on_token=None):
    """(seconds to the first token, the last event's timings or usage)."""
    body = dict(body, stream=True, temperature=0)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    t0 = time.monotonic()
    first, last = None, {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            now = time.monotonic()
            if first is None:
                first = now - t0
            if on_token:
                on_token(now)
            last = json.loads(line[6:])
    return first, last

def stall(long_prompt):
    """Largest gap (ms) between two tokens of two running streams, without and then during a long prefill."""
    gaps, lock, stop = [], threading.Lock(), threading.Event()
    def runner():
        while not stop.is_set():
            prev = [None]
            def tick(now):
                with lock:
                    if prev[0] is not None:
                        gaps.append((prev[0], now))
                prev[0] = now
            stream({"prompt": [1] + other[:8], "max_tokens": 400, "ignore_eos": True}, tick)
    ts = [threading.Thread(target=runner) for _ in range(2)]
    for t in ts:
        t.start()
    time.sleep(1.5)
    quiet_from, quiet_to = time.monotonic() - 1.0, time.monotonic()
    t0 = time.monotonic()
    stream({"prompt": long_prompt, "max_tokens": 1})
    t1 = time.monotonic()
    stop.set()
    for t in ts:
        t.join(timeout=120)
    quiet = max((b - a for a, b in gaps if a >= quiet_from and b <= quiet_to), default=0.0)
    during = max((b - a for a, b in gaps if b >= t0 and a <= t1), default=0.0)
    return quiet * 1e3, during * 1e3, (t1 - t0)

rows = {c: [] for c in chunks}
for r in range(rounds):
    for c in chunks:
        p = serve(c)
        try:
            cold, _ = stream({"prompt": prefix, "max_tokens": 1})
            warm, last = stream({"prompt": turn, "max_tokens": 1})
            cache_n = (last.get("timings") or {}).get("cache_n")
            if cache_n is None:
                cache_n = ((last.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
            quiet, during, prefill = stall(other[:N - 1] + [7])
            rows[c].append({"cold_s": cold, "warm_s": warm, "cache_n": cache_n, "quiet_gap_ms": quiet,
                            "stall_gap_ms": during, "prefill_under_load_s": prefill})
            print(f"round {r + 1}, prefill_chunk {c}: " + json.dumps(rows[c][-1]), flush=True)
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)
for c, rs in rows.items():
    med = lambda k: statistics.median(x[k] for x in rs)
    print(f"prefill_chunk {c}: {N}-token prompt cold TTFT {med('cold_s'):.2f} s, warm (+16 tokens, cache_n "
          f"{rs[-1]['cache_n']}) {med('warm_s') * 1e3:.0f} ms = {100 * med('warm_s') / med('cold_s'):.1f}% of cold; "
          f"largest gap of 2 running streams {med('quiet_gap_ms'):.0f} ms quiet, {med('stall_gap_ms'):.0f} ms while "
          f"another {N}-token prompt prefilled ({med('prefill_under_load_s'):.1f} s)")
PY
echo "load after: $(uptime)"
