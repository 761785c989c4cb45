#!/usr/bin/env bash
# DS4_TRACE (shared/request_trace.h), as bench/proxy_trace.sh uses it: a
# supervisor started with it has its proxy and its worker record each
# request's way by id; 300 requests at concurrency 4 must all be traced whole
# (every stage in the proxy's file and the worker's, paired by id, and the
# client's send and end paired by its port) with their times in order
# (trace_report.py --check).
# Exit 0 = pass, 1 = fail, 77 = skipped (reason printed).
set -u
: "${DS4_SRC:?}" "${DS4_BIN:?}"
model=${DS4_MODELS:-$DS4_SRC/../shared/models}/stories260K.gguf
[ -f "$model" ] || { echo "SKIP: no $model"; exit 77; }
command -v python3 >/dev/null || { echo "SKIP: no python3"; exit 77; }
command -v cc >/dev/null || { echo "SKIP: no C compiler for bench/http_load.c"; exit 77; }
out=$(mktemp -d /tmp/ds4-test-trace-XXXXXX)
trap 'rm -rf "$out"' EXIT
fail=0

if DS4_DEVICE=cpu DS4_TRACE_DIR=$out/on bash "$DS4_SRC/bench/proxy_trace.sh" 4 300 --check 300 >"$out/report" 2>&1; then
  echo "ok   - 300 requests traced whole, times in order"
else
  echo "FAIL - the trace of 300 requests:"; cat "$out/report"; fail=1
fi
grep -q "^300 requests traced whole" "$out/report" || { echo "FAIL - the report's count"; fail=1; }
ls "$out/on"/trace.worker-0-* >/dev/null 2>&1 && [ -s "$out/on/trace.proxy" ] &&
  echo "ok   - a file for the proxy and one for worker 0" || { echo "FAIL - the trace files: $(ls "$out/on")"; fail=1; }

exit $fail
