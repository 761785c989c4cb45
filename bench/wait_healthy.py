#!/usr/bin/env python3
"""Waits until GET /health answers 200 on each 127.0.0.1:PORT (a GPU worker
may take a while to start), at most 120 s in all; exits 1 saying which port
did not.
    bench/wait_healthy.py PORT [PORT...]"""
import sys
import time
import urllib.request

deadline = time.monotonic() + 120
for port in sys.argv[1:]:
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            break
        except Exception as e:
            if time.monotonic() > deadline:
                sys.exit(f"bench: port {port} not healthy after 120 s: {e}")
            time.sleep(0.1)
