"""Integration test of `ds4-worker serve` (see test_worker_daemon.sh)."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from ds4test import *  # noqa: F401,F403

if not os.path.exists(STORIES):
    skip(f"{STORIES} is missing")

seg = load_segment()
check(seg.startswith("ds4-model-"), f"model loaded into shared memory segment {seg}")
weights = os.path.getsize(f"/dev/shm/{seg}")

a = Daemon(seg, context=256, slots=2)
info = a.info()
check(info["ctx"] == 256 and info["slots"] == 2 and info["n_vocab"] == 512, "info reports context, slots, vocabulary")
check(info["plan"]["kv"] == 2 * 5 * 2 * 256 * 32 * 2, "info reports the KV plan (f16, 5 layers, 2 slots, 256, kv_dim 32)")

# Greedy generation, streamed token by token with log-probs, then timings.
ev = request(a.sock, {"op": "generate", "prompt": ONCE, "max_tokens": 12, "temperature": 0, "logprobs": 2})
toks = tokens_of(ev)
check(toks == ONCE_NEXT, f"greedy tokens match llama.cpp: {toks}")
check([e["i"] for e in ev if e["ev"] == "token"] == list(range(12)), "token events are numbered 0..11")
check(all(len(e.get("top", [])) == 2 and e["lp"] <= 0 for e in ev if e["ev"] == "token"), "log-probs and alternatives")
done = ev[-1]
check(done["ev"] == "done" and done["reason"] == "length", "final event says done/length")
check(done["timings"]["predicted_n"] == 12 and done["timings"]["prompt_n"] >= 1, "final event has timings")

# Resume: the same request with 5 generated tokens continues with the other 7.
ev = request(a.sock, {"op": "generate", "prompt": ONCE, "generated": ONCE_NEXT[:5], "max_tokens": 12, "temperature": 0})
check(tokens_of(ev) == ONCE_NEXT[5:], "a resumed request continues exactly")
check([e["i"] for e in ev if e["ev"] == "token"] == list(range(5, 12)), "resumed tokens keep their indices")
check(ev[-1]["timings"]["cache_n"] >= 5, "the resumed request reused the slot's cached prefix")

# Seeded sampling is reproducible.
req = {"op": "generate", "prompt": ONCE, "max_tokens": 20, "temperature": 1.0, "seed": 99}
check(tokens_of(request(a.sock, req)) == tokens_of(request(a.sock, req)), "same seed, same tokens")

# Requests without id one after another on one connection (tools and tests
# talk this way): each answer ends with its last event and the
# connection stays open for the next; a line that cannot be parsed gets an
# error and the connection closes.
s = connect(a.sock)
first = exchange(s, {"op": "generate", "prompt": ONCE, "max_tokens": 12, "temperature": 0})
second = exchange(s, {"op": "generate", "prompt": ONCE, "generated": ONCE_NEXT[:5], "max_tokens": 12, "temperature": 0})
third = exchange(s, {"op": "info"})
check(tokens_of(first) == ONCE_NEXT and tokens_of(second) == ONCE_NEXT[5:] and third[-1]["ev"] == "info",
      "one connection serves successive requests (generate, resumed generate, info)")
# Lines sent while a request runs wait for its end and are then served in
# order; the bad one last closes the connection after the answers before it.
line = lambda r: (json.dumps(r) + "\n").encode()
s.sendall(line({"op": "generate", "prompt": ONCE, "max_tokens": 40, "ignore_eos": True, "temperature": 0}) +
          line({"op": "generate", "prompt": ONCE, "max_tokens": 12, "temperature": 0}) + line({"op": "info"}) +
          b"{not json\n")
buf = b""
while chunk := s.recv(65536):
    buf += chunk
queued = [json.loads(l) for l in buf.splitlines()]
ends = [i for i, e in enumerate(queued) if e["ev"] != "token"]
check(len(ends) == 4 and ends[0] == 40 and ends[1] == 53 and [queued[i]["ev"] for i in ends] == ["done", "done", "info", "error"]
      and tokens_of(queued[ends[0] + 1:ends[1] + 1]) == ONCE_NEXT,
      "lines sent while a request runs are answered after it, in order; a bad one closes the connection after them")
s.close()
s = connect(a.sock)
bad_then = exchange(s, b"{not json\n")
check(len(bad_then) == 1 and bad_then[0]["ev"] == "error" and s.recv(100) == b"",
      "an unparsable line on a kept connection gets an error, then the connection closes")
s.close()

# Requests with ids share one connection, as the proxy sends them: lines are
# read at once, every event carries its request's id, and each request's
# events are exactly its answer alone.
def read_until(s, done, timeout=30):
    """Events from s until done(events) holds, the connection closes or the time is up."""
    events, buf, deadline = [], b"", time.time() + timeout
    while time.time() < deadline and not done(events):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            l, buf = buf.split(b"\n", 1)
            events.append(json.loads(l))
    return events

ended = lambda ids: lambda evs: ids <= {e.get("id") for e in evs if e["ev"] in ("done", "error")}
s = connect(a.sock)
s.sendall(line({"op": "generate", "id": 1, "prompt": ONCE, "max_tokens": 60, "ignore_eos": True, "temperature": 0}) +
          line({"op": "generate", "id": 2, "prompt": ONCE, "max_tokens": 12, "temperature": 0}) + line({"op": "info"}))
mux = read_until(s, ended({1, 2}))
of = lambda i: [e for e in mux if e.get("id") == i]
ends_at = {e["id"]: k for k, e in enumerate(mux) if e["ev"] == "done"}
info_at = next((k for k, e in enumerate(mux) if e["ev"] == "info"), None)
check(tokens_of(of(2)) == ONCE_NEXT and [e["i"] for e in of(2) if e["ev"] == "token"] == list(range(12))
      and of(2)[-1]["ev"] == "done" and of(2)[-1]["reason"] == "length",
      "two requests on one connection: the shorter one's events (id 2) are its answer alone")
check(tokens_of(of(1))[:12] == ONCE_NEXT and len(tokens_of(of(1))) == 60 and of(1)[-1]["reason"] == "length",
      "the longer one's events (id 1) are complete and in order")
check(len(mux) == 60 + 12 + 2 + 1 and all("id" in e for e in mux if e["ev"] != "info"),
      "every event of a request with an id carries it, and nothing else comes")
check(info_at is not None and ends_at.get(2, 99) < ends_at.get(1, -1) and info_at < ends_at.get(1, -1),
      "they run at once: the short one ends first, and info is answered while the long one runs")
# Cancel by id: its done line says cancelled; the connection serves on. A
# cancel for an id that ended (or never ran) changes nothing.
s.sendall(line({"op": "generate", "id": 3, "prompt": ONCE, "max_tokens": 100000, "ignore_eos": True, "temperature": 0}))
first = read_until(s, lambda evs: len(evs) >= 1)
s.sendall(line({"op": "cancel", "id": 3}) + line({"op": "cancel", "id": 2}) + line({"op": "cancel", "id": 77}))
cancelled = read_until(s, ended({3}))
check(first and first[0].get("id") == 3 and cancelled and cancelled[-1] == {**cancelled[-1], "ev": "done", "id": 3, "reason": "cancelled"},
      "a cancel by id ends that request with reason cancelled")
again = read_until(s.sendall(line({"op": "generate", "id": 2, "prompt": ONCE, "max_tokens": 3, "temperature": 0})) or s, ended({2}))
check(tokens_of(again) == ONCE_NEXT[:3] and a.info()["busy"] == 0,
      "after cancels of running, ended and unknown ids the connection serves on (an ended id may come again)")
# An id already running on the connection is a broken line: error, close.
s.sendall(line({"op": "generate", "id": 5, "prompt": ONCE, "max_tokens": 100000, "ignore_eos": True, "temperature": 0}) +
          line({"op": "generate", "id": 5, "prompt": ONCE, "max_tokens": 3, "temperature": 0}))
dup = read_until(s, lambda evs: False, timeout=10)
errs = [e for e in dup if e["ev"] == "error"]
check(len(errs) == 1 and "id" not in errs[0] and "already running" in errs[0]["message"] and dup[-1]["ev"] == "done"
      and dup[-1]["id"] == 5 and dup[-1]["reason"] == "cancelled",
      "a second request with a running id gets an error, the running one is cancelled, the connection closes")
s.close()
# Closing the connection cancels every request running on it.
s = connect(a.sock)
s.sendall(line({"op": "generate", "id": 1, "prompt": ONCE, "max_tokens": 100000, "ignore_eos": True, "temperature": 0}) +
          line({"op": "generate", "id": 2, "prompt": ONCE, "max_tokens": 100000, "ignore_eos": True, "temperature": 0}))
read_until(s, lambda evs: {1, 2} <= {e.get("id") for e in evs})
check(a.info()["busy"] == 2, "two requests with ids run at once in the two slots")
s.close()
deadline = time.time() + 10
while time.time() < deadline and a.info()["busy"] != 0:
    time.sleep(0.01)
check(a.info()["busy"] == 0, "closing the connection cancels all its requests")

# A reader slower than the generation: what the socket cannot take waits in
# the worker, in order, and nothing is lost.
c = Daemon(seg, context=2048, slots=1)
long_req = {"op": "generate", "prompt": ONCE, "max_tokens": 1900, "temperature": 0, "logprobs": 20, "ignore_eos": True}
fast = request(c.sock, long_req)
s = connect(c.sock)
s.sendall((json.dumps(long_req) + "\n").encode())
time.sleep(1.0)  # about 1 MB of lines, several times the socket's buffer
slow = exchange(s, b"")
s.close()
check([e["i"] for e in slow if e["ev"] == "token"] == list(range(1900)) and slow[-1]["ev"] == "done",
      "a slow reader gets every token in order, then done")
check(tokens_of(slow) == tokens_of(fast), "the slow reader's answer is the fast reader's")
c.stop()

# Bad input: a clear error, and the daemon keeps serving.
bad = [
    (b"{not json\n", "not valid JSON"),
    (b"[1,2]\n", "JSON object"),
    (json.dumps({"op": "generate", "prompt": [1, 99999]}).encode() + b"\n", "out of range"),
    (json.dumps({"op": "generate", "prompt": [1, -4]}).encode() + b"\n", "not a token id"),
    (json.dumps({"op": "generate", "prompt": ONCE, "max_tokens": 10**12}).encode() + b"\n", "out of range"),
    (json.dumps({"op": "generate", "prompt": [5] * 300}).encode() + b"\n", "context is 256"),
    (json.dumps({"op": "generate", "prompt": ONCE, "temperature": "hot"}).encode() + b"\n", "must be a number"),
    (json.dumps({"op": "explode"}).encode() + b"\n", "unknown op"),
    (b"x" * (33 << 20) + b"\n", "too long"),
]
for raw, want in bad:
    ev = request(a.sock, raw)
    check(len(ev) == 1 and ev[0]["ev"] == "error" and want in ev[0]["message"],
          f"bad request -> error containing '{want}': {ev[0]['message'][:80] if ev else 'nothing'}")
check(a.proc.poll() is None and tokens_of(request(a.sock, {"op": "generate", "prompt": ONCE, "max_tokens": 3, "temperature": 0})) == ONCE_NEXT[:3],
      "the daemon still serves after bad input")

# Cancel on disconnect: the slot is freed.
s = connect(a.sock)
s.sendall((json.dumps({"op": "generate", "prompt": ONCE, "max_tokens": 100000, "ignore_eos": True, "temperature": 0}) + "\n").encode())
s.recv(100)
s.close()
deadline = time.time() + 10
while time.time() < deadline and a.info()["busy"] != 0:
    time.sleep(0.01)
check(a.info()["busy"] == 0, "a disconnected client's request is cancelled and its slot freed")

# A second daemon on the same segment shares the weights' pages.
b = Daemon(seg, context=256, slots=2)
for d in (a, b):
    request(d.sock, {"op": "generate", "prompt": ONCE, "max_tokens": 4, "temperature": 0})
rss_a, pss_a = smaps_of(a.proc.pid, seg)
rss_b, pss_b = smaps_of(b.proc.pid, seg)
print(f"segment {weights} bytes; worker A Rss {rss_a} Pss {pss_a}; worker B Rss {rss_b} Pss {pss_b}")
check(rss_a > 0.5 * weights and rss_b > 0.5 * weights, "both workers have the weights resident")
check(pss_a + pss_b <= 1.05 * max(rss_a, rss_b), "the two workers share one copy (Pss adds up to one Rss)")

# SIGKILL B in the middle of a long generation; A is unaffected.
results = {}

def long_gen(name, d):
    try:
        results[name] = request(d.sock, {"op": "generate", "prompt": ONCE, "max_tokens": 200, "temperature": 0,
                                         "ignore_eos": True}, timeout=60)
    except Exception as e:  # the killed worker's connection breaks
        results[name] = e

ta = threading.Thread(target=long_gen, args=("a", a))
tb = threading.Thread(target=long_gen, args=("b", b))
ta.start(); tb.start()
time.sleep(0.05)
b.stop(signal.SIGKILL)
ta.join(60); tb.join(60)
ev_a = results.get("a")
check(isinstance(ev_a, list) and ev_a and ev_a[-1].get("ev") == "done" and len(tokens_of(ev_a)) == 200,
      "worker A finished its generation while B was killed")
check(tokens_of(ev_a)[:12] == ONCE_NEXT, "worker A's answer is still correct")
check(b.proc.returncode == -9, "worker B died of SIGKILL")
run_p = run(os.path.join(BIN, "ds4-worker"), "run", "--model", STORIES, "-p", "Once upon a time", "-n", "12",
            "--temp", "0", "--json")
check(run_p.returncode == 0 and json.loads(run_p.stdout)["tokens"] == ONCE_NEXT, "the segment is intact after the kill")

# A restarted worker attaches the same segment and is ready again.
b2 = Daemon(seg, context=256, slots=2)
print(f"restarted worker ready {b2.ready_after * 1000:.1f} ms after exec")
check(tokens_of(request(b2.sock, {"op": "generate", "prompt": ONCE, "max_tokens": 12, "temperature": 0})) == ONCE_NEXT,
      "the restarted worker serves")

# SIGTERM: a clean stop. A request running on a kept connection is
# cancelled (the proxy resumes it elsewhere) and the connection closes.
s = connect(a.sock)
s.sendall(line({"op": "generate", "prompt": ONCE, "max_tokens": 100000, "ignore_eos": True, "temperature": 0}))
s.recv(100)
rc = a.stop(signal.SIGTERM)
buf = b""
while chunk := s.recv(65536):
    buf += chunk
last = json.loads(buf.splitlines()[-1])
check(last["ev"] == "done" and last["reason"] == "cancelled", f"SIGTERM cancels a running request and closes its connection: {last}")
s.close()
check(rc == 0, f"SIGTERM stops the worker cleanly (exit {rc})")
check(not os.path.exists(a.sock), "the socket is removed on stop")
check("stopping on signal" in a.output(), "the worker logs that it stops")
b2.stop()

# workers.busy_poll: an idle worker polls its sockets for --busy-poll-us (or
# DS4_BUSY_POLL_US, from ds4-worker@.service's environment file) before it
# sleeps, so the next request skips its wake-up. Twenty requests 30 ms apart:
# a worker that polls 10 ms after each spends about 200 ms of CPU on them, one
# that sleeps about a millisecond.
def cpu_ms(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")  # utime + stime


def cpu_for_requests(d):
    before = cpu_ms(d.proc.pid)
    for _ in range(20):
        request(d.sock, {"op": "generate", "prompt": ONCE, "max_tokens": 1, "temperature": 0})
        time.sleep(0.03)
    return cpu_ms(d.proc.pid) - before


sleeper = Daemon(seg, context=256, slots=1)
poller = Daemon(seg, context=256, slots=1, extra=("--busy-poll-us", "10000"))
os.environ["DS4_BUSY_POLL_US"] = "10000"
poller_env = Daemon(seg, context=256, slots=1)
del os.environ["DS4_BUSY_POLL_US"]
slept, polled, polled_env = (cpu_for_requests(d) for d in (sleeper, poller, poller_env))
check(slept < 50 and polled >= 60 and polled > 3 * slept,
      f"--busy-poll-us 10000: the idle worker polls ({polled:.0f} ms of CPU for 20 requests, {slept:.0f} ms without)")
check(polled_env >= 60 and polled_env > 3 * slept,
      f"DS4_BUSY_POLL_US=10000 does the same ({polled_env:.0f} ms of CPU)")
for d in (sleeper, poller, poller_env):
    d.stop()

# A plan that cannot fit fails fast with the figures, and exit status 75: the
# supervisor's cue to go one rung down instead of counting a crash.
p = run(os.path.join(BIN, "ds4-worker"), "serve", "--segment", seg, "--socket", "/tmp/ds4-nofit.sock",
        "--context", str(1 << 24), "--slots", "256", timeout=30)
check(p.returncode == 75 and "memory plan does not fit" in p.stderr and "KV cache" in p.stderr,
      f"an impossible plan is refused (exit {p.returncode}): {p.stderr.strip()[-200:]}")

# Broken model files are refused with a clear error, never a crash.
import tempfile
tmp = tempfile.mkdtemp(prefix="ds4-badgguf-")
data = open(STORIES, "rb").read()
cases = {"magic.gguf": b"XXXX" + data[4:], "truncated.gguf": data[: len(data) // 2], "empty.gguf": b""}
for name, content in cases.items():
    path = os.path.join(tmp, name)
    open(path, "wb").write(content)
    p = run(os.path.join(BIN, "ds4-worker"), "run", "--model", path, "-p", "x", "-n", "1")
    check(p.returncode == 1 and name in p.stderr, f"{name}: clear error ({p.stderr.strip()[:100]})")
p = run(os.path.join(BIN, "ds4-worker"), "run", "--model", os.path.join(tmp, "missing.gguf"), "-p", "x")
check(p.returncode == 1 and "missing.gguf" in p.stderr, "missing model file: clear error")

# Command-line slips are named, before any work.
worker, mkmodel = os.path.join(BIN, "ds4-worker"), os.path.join(BIN, "ds4-mkmodel")
p = run(worker, "run", "--model", STORIES, "-n", "2")
check(p.returncode == 1 and "missing option '--prompt'" in p.stderr and p.stdout == "", "run without -p: refused")
p2 = run(worker, "run", "--model", STORIES, "-p", "Once upon a time " * 10, "--ctx", "16", "-n", "2")
check(p2.returncode == 1 and "a context of 16 (--context) holds at most 15" in p2.stderr and p2.stdout == "",
      f"run: a prompt over --context (given as --ctx) is refused before it is echoed ({p2.stderr.strip()[:120]})")
p = run(mkmodel, "--bogus", "x")
check(p.returncode == 1 and "unknown option '--bogus'" in p.stderr, "mkmodel: an unknown option is named")
p = run(mkmodel, "--out", os.path.join(tmp, "m.gguf"), "--vocab-from", STORIES, "--preset", "stories-like", "--dim", "0")
check(p.returncode == 1 and "--dim: must be at least 1" in p.stderr and not os.path.exists(os.path.join(tmp, "m.gguf")),
      "mkmodel: --dim 0 is refused, not replaced by the preset's")

finish()
