#!/usr/bin/env bash
# The worker daemon over its Unix socket, with the real model: protocol, bad
# input, cancel on disconnect, resume, two daemons sharing one copy of the
# weights, SIGKILL of one mid-generation, SIGTERM, and a plan that cannot fit.
exec python3 "$(dirname "$0")/worker_daemon_test.py"
