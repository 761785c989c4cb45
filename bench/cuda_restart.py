#!/usr/bin/env python3
"""How long a killed ds4-worker takes to answer again.

Starts `CMD` (a `ds4-worker serve ... --socket SOCKET` command line), waits
until it answers `{"op":"info"}` on SOCKET, then REPS times: SIGKILL, start
it again at once (as the supervisor does), and time kill -> `info` answered
and kill -> first token of a 1-token greedy request. One JSON line per
measurement on stdout.

  cuda_restart.py --label holder --socket /tmp/w.sock --reps 3 -- ds4-worker serve ...
"""
import argparse
import json
import signal
import socket
import subprocess
import sys
import time


def ask(path, request, timeout):
    """Sends one request, returns the answer's lines (up to `done`/`info`/`error`)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall((json.dumps(request) + "\n").encode())
        buf = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            lines = [json.loads(l) for l in buf.split(b"\n") if l.strip()]
            if lines and lines[-1].get("ev") in ("info", "done", "error") and buf.endswith(b"\n"):
                return lines
        return [json.loads(l) for l in buf.split(b"\n") if l.strip()]
    finally:
        s.close()


def wait_answering(path, proc, limit):
    """Polls `info` every 2 ms until it answers; seconds waited, or raises."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if proc.poll() is not None:
            raise RuntimeError("the worker exited with status %d" % proc.returncode)
        try:
            answer = ask(path, {"op": "info"}, 5)
            if answer and answer[-1].get("ev") == "info":
                return answer[-1]
        except (OSError, ValueError):
            pass
        time.sleep(0.002)
    raise RuntimeError("no answer within %.0f s" % limit)


def one_token(path):
    lines = ask(path, {"op": "generate", "prompt": [1, 2, 3, 4], "max_tokens": 1, "temperature": 0}, 60)
    return [l for l in lines if l.get("ev") == "token"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--limit", type=float, default=120)
    ap.add_argument("--log", default="/dev/null")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    log = open(a.log, "ab")

    def spawn():
        return subprocess.Popen(cmd, stdout=log, stderr=log)

    t0 = time.monotonic()
    proc = spawn()
    info = wait_answering(a.socket, proc, a.limit)
    first = time.monotonic() - t0
    print(json.dumps({"label": a.label, "what": "first start", "answer_s": round(first, 4),
                      "backend": info.get("backend")}), flush=True)
    try:
        for r in range(a.reps):
            proc.send_signal(signal.SIGKILL)
            t_kill = time.monotonic()
            proc.wait()
            proc = spawn()
            wait_answering(a.socket, proc, a.limit)
            t_info = time.monotonic() - t_kill
            toks = one_token(a.socket)
            t_tok = time.monotonic() - t_kill
            print(json.dumps({"label": a.label, "what": "restart after SIGKILL", "rep": r,
                              "kill_to_info_s": round(t_info, 4), "kill_to_token_s": round(t_tok, 4),
                              "tokens": len(toks)}), flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
