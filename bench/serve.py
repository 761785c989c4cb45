#!/usr/bin/env python3
"""Serving throughput against llama-server (issue 25): the same GGUF served by
ds4 (the supervisor, process backend) and by the peer's llama-server
(../shared/peers/llama.cpp), each with as many slots as there are clients
(`-np` equal to ds4's `workers.slots`) and the same threads; C clients send
requests one after another for a fixed time, and the aggregate completion
tokens per second is compared, the two servers alternating in rounds.

  bench/serve.py [MODEL=build/models/207m-f16.gguf] [CLIENTS="1 8 32"] [ROUNDS=3] [SECONDS=20]

A request: /v1/completions, a prompt of about 33 tokens (different for each
request, so that no prefix cache serves it), max_tokens 64, temperature 0
(DS4_TEMPERATURE=T: sampled at T with a seed per request, as agents ask:
both servers then pick tokens on the host).
Random weights write byte tokens that make invalid UTF-8, which llama-server
refuses, and end-of-text early: with a SentencePiece vocabulary both servers
get the same logit_bias banning the byte tokens and the end of text, so that
every request generates its 64 tokens. Both run at once (different ports),
only one takes load at a time. Environment: DS4_BIN (build/bin), DS4_PEER
(../shared/peers/llama.cpp/bin), DS4_THREADS (2), DS4_DEVICE (ds4's
workers.device, default auto), DS4_PEER_ARGS (more llama-server arguments,
split on blanks: on a GPU `-ngl 99 -fa on`). Run it on a quiet machine, with
priority (`nice -n -20`) on a shared one."""
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)
model = os.path.realpath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "build/models/207m-f16.gguf"))
clients = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "1 8 32").split()]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 20
bin_dir = os.path.realpath(os.environ.get("DS4_BIN", os.path.join(root, "build/bin")))
peer = os.path.realpath(os.environ.get("DS4_PEER", os.path.join(root, "../shared/peers/llama.cpp/bin")))
threads = int(os.environ.get("DS4_THREADS", "2"))
device = os.environ.get("DS4_DEVICE", "auto")
peer_args = os.environ.get("DS4_PEER_ARGS", "").split()
CTX = 256  # per slot: 33 + 64 tokens fit
MAX_TOKENS = 64
TEMPERATURE = float(os.environ.get("DS4_TEMPERATURE", "0"))
for path, what in ((model, "the model"), (f"{bin_dir}/ds4-supervisor", "ds4-supervisor"),
                   (f"{peer}/llama-server", "llama-server")):
    if not os.path.exists(path):
        sys.exit(f"bench: {what} ({path}) is missing")

d = tempfile.mkdtemp(prefix="ds4-serve-")
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


def post(port, path, body, timeout=600):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(port, log, proc):
    for _ in range(1200):
        if proc.poll() is not None:
            sys.exit(f"bench: the server on port {port} exited; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.25)
    sys.exit(f"bench: the server on port {port} did not become ready; see {log}")


def start(n_slots):
    """Both servers with n_slots slots; returns {name: port}."""
    ports = {"ds4": 18311, "llama.cpp": 18312}
    run = f"{d}/run-{n_slots}"
    os.makedirs(run, mode=0o700)
    cfg = f"{d}/ds4-{n_slots}.yaml"
    with open(cfg, "w") as f:
        f.write(f"""model:
  path: {model}
  name: bench
proxy:
  listen: 127.0.0.1:{ports['ds4']}
workers:
  backend: process
  count: 1
  device: {device}
  slots: {n_slots}
  threads: {threads}
  context:
    ladder: [{CTX}]
""")
    logs = {n: f"{d}/{n}-{n_slots}.log" for n in ports}
    started = {}
    started["ds4"] = subprocess.Popen([f"{bin_dir}/ds4-supervisor", "--config", cfg, "--no-keeper"],
                                      env=dict(os.environ, XDG_RUNTIME_DIR=run),
                                      stdout=open(logs["ds4"], "w"), stderr=subprocess.STDOUT)
    started["llama.cpp"] = subprocess.Popen(
        [f"{peer}/llama-server", "-m", model, "--port", str(ports["llama.cpp"]), "-t", str(threads), "-tb",
         str(threads), "-np", str(n_slots), "-c", str(CTX * n_slots), "--no-webui"] + peer_args,
        stdout=open(logs["llama.cpp"], "w"), stderr=subprocess.STDOUT)
    procs.extend(started.values())
    for n, p in started.items():
        wait_ready(ports[n], logs[n], p)
    return ports, started


def stop(started):
    for p in started.values():
        p.terminate()
    for p in started.values():
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
        procs.remove(p)


def gguf_vocab(path):
    """The tokenizer's token types and end-of-text id from a GGUF's metadata."""
    import struct
    scalars = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    want = {"tokenizer.ggml.token_type", "tokenizer.ggml.eos_token_id"}
    out = {}
    with open(path, "rb") as f:
        def rd(fmt):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def string():
            return f.read(rd("<Q")).decode("utf-8", "replace")

        def value(t, keep):
            if t == 8:
                return string()
            if t == 9:
                et, n = rd("<I"), rd("<Q")
                if et in scalars and not keep:  # skipped in one seek
                    f.seek(n * struct.calcsize(scalars[et]), 1)
                    return None
                return [value(et, keep) for _ in range(n)]
            return rd(scalars[t])

        if f.read(4) != b"GGUF":
            sys.exit(f"bench: {path} is not a GGUF file")
        rd("<I")
        rd("<Q")
        for _ in range(rd("<Q")):
            key = string()
            v = value(rd("<I"), key in want)
            if key in want:
                out[key] = v
    out.setdefault("tokenizer.ggml.token_type", [])
    return out


def load(port, n_clients, bias, words, rng_seed):
    """n_clients clients for `seconds`: completion tokens per second, and the count of failures."""
    done = [0] * n_clients
    failed = [0] * n_clients
    stop_at = time.monotonic() + seconds
    t_first = time.monotonic()

    def client(i):
        rng = random.Random(rng_seed * 1000 + i)
        while time.monotonic() < stop_at:
            prompt = " ".join(rng.choice(words) for _ in range(24))
            try:
                r = post(port, "/v1/completions", {"model": "bench", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                   "temperature": TEMPERATURE, "seed": rng.randrange(1 << 30),
                                                   "logit_bias": bias})
                done[i] += int(r["usage"]["completion_tokens"])
            except Exception as e:  # counted, and shown once
                if failed[i] == 0:
                    print(f"  client {i}: {e}", file=sys.stderr)
                failed[i] += 1

    ts = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(done) / (time.monotonic() - t_first), sum(failed)


try:
    # The byte tokens (token type 6) and the end of text, from the model's own vocabulary.
    vocab = gguf_vocab(model)
    bias = {str(i): -100 for i, t in enumerate(vocab["tokenizer.ggml.token_type"]) if t == 6}
    if not bias:
        print("byte tokens: none to ban (a byte-level BPE vocabulary: a random model must come from "
              "ds4-mkmodel --no-byte-tokens, or llama-server fails the answers that are not whole UTF-8)")
    if "tokenizer.ggml.eos_token_id" in vocab:
        bias[str(vocab["tokenizer.ggml.eos_token_id"])] = -100
    words = "once upon a time there was a little girl who liked to play in the park with her dog and cat".split()
    print(f"model {model}, {threads} threads, ds4 device {device}, llama-server {' '.join(peer_args) or '(CPU)'}, "
          f"{seconds:.0f} s a measurement, {rounds} rounds, {len(bias)} tokens banned, temperature {TEMPERATURE}")
    print(f"load before: {os.getloadavg()}")
    summary = []
    for n in clients:
        ports, started = start(n)
        for name, port in ports.items():  # warm-up
            post(port, "/v1/completions", {"model": "bench", "prompt": "once upon", "max_tokens": 8,
                                           "temperature": 0, "logit_bias": bias})
        res = {name: [] for name in ports}
        fails = {name: 0 for name in ports}
        for r in range(rounds):
            order = list(ports) if r % 2 == 0 else list(reversed(ports))
            for name in order:
                rate, failed = load(ports[name], n, bias, words, r)
                res[name].append(rate)
                fails[name] += failed
                print(f"  {n:2d} clients, round {r + 1}, {name:9s}: {rate:7.1f} tok/s" +
                      (f", {failed} failed" if failed else ""), flush=True)
        ratio = statistics.median(a / b for a, b in zip(res["ds4"], res["llama.cpp"]))
        summary.append((n, statistics.median(res["ds4"]), statistics.median(res["llama.cpp"]), ratio, fails))
        stop(started)
    print(f"load after: {os.getloadavg()}")
    print("clients | ds4 tok/s | llama-server tok/s | ds4 / llama-server (median of rounds)")
    for n, a, b, ratio, fails in summary:
        extra = "" if not any(fails.values()) else f"   failed: {fails}"
        print(f"{n:7d} | {a:9.1f} | {b:18.1f} | {ratio:.2f}x{extra}")
finally:
    cleanup()
