# shellcheck shell=bash
# Helpers for tests that run on a GPU machine (test_supervisor_gpu*.sh).
#
#   gpu_complete URL MODEL     one greedy /v1/completions request (python: a GPU
#                              machine may lack curl); prints the body's text,
#                              then the HTTP status on a line of its own
#   gpu_take OUT LEAVE         another process (PyTorch) takes the GPU's free
#                              memory but LEAVE bytes, or with LEAVE = all every
#                              MiB it can get, and holds it for 5 minutes; it
#                              writes what it took to OUT once it has it. $HOG
#                              is its pid; false when it did not get there.

gpu_complete() {
  python3 - "$1/v1/completions" "$2" <<'PY'
import json, sys, urllib.request, urllib.error
req = urllib.request.Request(sys.argv[1], json.dumps({"model": sys.argv[2], "prompt": "Once upon a time",
                             "max_tokens": 24, "temperature": 0}).encode(), {"content-type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=60) as r:
        body = json.loads(r.read())
        print(body["choices"][0]["text"]); print(r.status)
except urllib.error.HTTPError as e:
    print(e.read().decode(errors="replace")); print(e.code)
PY
}

gpu_take() {
  local out=$1
  rm -f "$out"
  python3 - "$out" "$2" <<'PY' &
import sys, time, torch
out, leave = sys.argv[1], sys.argv[2]
free = torch.cuda.mem_get_info()[0]
if leave == "all":
    blocks, size = [], free
    while size >= 2**20:
        try:
            blocks.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except RuntimeError:
            size //= 2
    left = torch.cuda.mem_get_info()[0]
    open(out, "w").write(f"{sum(b.numel() for b in blocks) >> 20} MiB more, {left >> 10} KiB left")
else:
    hog = torch.empty(max(free - int(leave), 0), dtype=torch.uint8, device="cuda")
    open(out, "w").write(f"{hog.numel() >> 20} MiB")
time.sleep(300)
PY
  HOG=$!
  local _
  for _ in $(seq 1 600); do
    [[ -s $out ]] && return 0
    kill -0 "$HOG" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
