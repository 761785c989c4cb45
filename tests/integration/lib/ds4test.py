"""Helpers for ds4's integration tests: run the real binaries, talk the
worker's token protocol, and bound every wait."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

BIN = os.environ.get("DS4_BIN", os.path.join(os.path.dirname(__file__), "../../../build/bin"))
MODELS = os.environ.get("DS4_MODELS", os.path.join(os.path.dirname(__file__), "../../../../shared/models"))
STORIES = os.path.join(MODELS, "stories260K.gguf")
ONCE = [1, 403, 407, 261, 378]  # "Once upon a time" with BOS
ONCE_NEXT = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338]

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def finish():
    if failures:
        print(f"{len(failures)} check(s) failed", flush=True)
        sys.exit(1)
    print("all checks passed", flush=True)
    sys.exit(0)


def skip(why):
    print("SKIP: " + why, flush=True)
    sys.exit(77)


def worker(*args):
    return os.path.join(BIN, "ds4-worker"), *args


def run(*cmd, timeout=120, check_rc=None):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return p


def load_segment(model=STORIES):
    p = run(os.path.join(BIN, "ds4-worker"), "load", "--model", model)
    if p.returncode != 0:
        raise RuntimeError("load failed: " + p.stderr)
    return p.stdout.strip().splitlines()[-1]


def connect(path, timeout=30):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s


def exchange(s, req, timeout=60):
    """Sends one request on an open connection; returns its events, up to the
    answer's last (done, error or info) or until the connection closes."""
    data = req if isinstance(req, (bytes, bytearray)) else (json.dumps(req) + "\n").encode()
    try:
        s.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the worker refused the request early; its answer is still queued
    events = []
    buf = b""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            events.append(json.loads(line))
        if events and events[-1].get("ev") in ("done", "error", "info"):
            break
    return events


def request(path, req, timeout=60):
    """Sends one request on a new connection and returns its events (exchange)."""
    s = connect(path, timeout)
    events = exchange(s, req, timeout)
    s.close()
    return events


def tokens_of(events):
    return [e["t"] for e in events if e.get("ev") == "token"]


class Daemon:
    """A `ds4-worker serve` process on its own socket."""

    def __init__(self, segment, context=256, slots=2, extra=(), wait=True):
        self.dir = tempfile.mkdtemp(prefix="ds4-worker-test-")
        self.sock = os.path.join(self.dir, "w.sock")
        self.log = open(os.path.join(self.dir, "log"), "w+")
        self.args = [os.path.join(BIN, "ds4-worker"), "serve", "--segment", segment, "--socket", self.sock,
                     "--context", str(context), "--slots", str(slots), "--threads", "1", *extra]
        self.t_start = time.time()
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        self.ready_after = None
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("worker exited: " + self.output())
            try:
                ev = request(self.sock, {"op": "info"}, timeout=5)
                if ev and ev[0].get("ev") == "info":
                    self.ready_after = time.time() - self.t_start
                    return ev[0]
            except OSError:
                pass
            time.sleep(0.005)
        raise RuntimeError("worker not ready in time: " + self.output())

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def info(self):
        return request(self.sock, {"op": "info"})[0]

    def stop(self, sig=15, timeout=10):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def smaps_of(pid, needle):
    """Rss and Pss (bytes) of the mappings of `pid` whose path contains `needle`."""
    rss = pss = 0
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and "-" in parts[0] and ":" in parts[3]:
                inside = needle in line
            elif inside and parts[0] == "Rss:":
                rss += int(parts[1]) * 1024
            elif inside and parts[0] == "Pss:":
                pss += int(parts[1]) * 1024
    return rss, pss
