#!/usr/bin/env bash
# Constrained decoding through the worker daemon with the real model: a
# generate line with "grammar" gives answers inside it at temperature 1, a
# resumed one continues exactly, and a bad grammar is an error event naming
# line:column while the daemon keeps serving.
exec python3 "$(dirname "$0")/worker_grammar_test.py"
