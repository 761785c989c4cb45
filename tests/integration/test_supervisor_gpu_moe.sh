#!/usr/bin/env bash
# The expert rung (workers.moe_offload) under the supervisor, on a GPU (skips
# without one): a mixture-of-experts model (qwen3moe, made by ds4-mkmodel)
# with moe_offload [0, 2, 4] and contexts [512, 256]. The holder keeps only
# what the last expert rung keeps on the device; the worker starts with every
# expert on the GPU (copying those the holder lacks). When another process
# (PyTorch) takes the GPU's memory, the worker first moves experts to the
# host at the same context (0 -> 2 -> 4 layers), and only then goes to the
# smaller context; each step is a journal event with the rung, shown by
# ds4ctl, /status.json and /metrics, and every step serves. When the memory
# is back, it climbs the same path up to every expert on the GPU.
# Exit 0 = pass, 1 = fail, 77 = skip (reason printed).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/lib/supervisor_env.sh"
. "$here/lib/gpu_env.sh"

command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || { echo "SKIP: no NVIDIA GPU here"; exit 77; }
python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null \
  || { echo "SKIP: no PyTorch with CUDA here to take the GPU's memory"; exit 77; }
sup_init || exit $?
if "$DS4_BIN/ds4-worker" hold --segment none 2>&1 | grep -q 'built without the CUDA backend'; then
  echo "SKIP: this ds4-worker was built without the CUDA backend"; exit 77
fi
trap sup_cleanup EXIT
unset DBUS_SESSION_BUS_ADDRESS

model=$SUP_DIR/moe.gguf
# 4 layers of 16 experts (4 a token), Q8_0: each layer's experts are ~12 MiB.
sup_synthetic_model "$model" --arch qwen3moe --dim 512 --layers 4 --heads 8 --kv-heads 4 --head-dim 64 \
  --ff 1024 --experts 16 --experts-used 4 --expert-ff 512 --type q8_0



cat >"$SUP_DIR/ds4.yaml" <<YAML
model:
  path: $model
proxy:
  listen: 127.0.0.1:0
workers:
  backend: process
  device: cuda:0
  slots: 2
  context:
    ladder: [512, 256]
  moe_offload: [0, 2, 4]
  reserve: 64MiB
headroom:
  min_available: 2GiB     # GPU free below this → the next rung
  for: 1s
  step_up_after: 3s
YAML
sup_start "$SUP_DIR/ds4.yaml" || { fail "supervisor did not start"; tail -n 30 "$SUP_DIR/sup.log"; exit 1; }
if sup_wait 120 'w[0]["state"] == "ready" and s["holder"] is not None and s["holder"]["state"] == "ready"'; then
  pass "holder and worker ready"
else
  fail "holder or worker not ready: $(sup_status | tr -d '\n' | cut -c1-600)"
  tail -n 40 "$SUP_DIR/sup.log"; exit 1
fi
# The holder holds all but the experts of the last rung's 4 layers; the
# worker at rung 0 copies those itself and computes none on the host.
[[ $(sup_get 'w[0]["context"]') == 512 && $(sup_get 'w[0]["host_experts"]') == 0 ]] \
  && pass "first start: context 512, every expert on the GPU" \
  || fail "first start at $(sup_get 'w[0]["context"]')/$(sup_get 'w[0]["host_experts"]')"
grep -aq 'holding .* without the experts of the first 4 layers' "$SUP_DIR/sup.log" \
  && pass "the holder keeps only what the last rung keeps on the GPU: $(grep -ao 'holding [^(]*' "$SUP_DIR/sup.log" | head -1)" \
  || fail "no holder without the last rung's experts in the log: $(grep -i 'holding' "$SUP_DIR/sup.log" | tail -2)"
grep -aq 'weights mapped from the holder' "$SUP_DIR/sup.log" && pass "the worker maps the holder's image" \
  || fail "the worker did not map the holder's image: $(grep -i 'holder\|weights' "$SUP_DIR/sup.log" | tail -5)"
grep -aq 'every expert on the device, the experts of layers 0 to 3 copied to this worker' "$SUP_DIR/sup.log" \
  && pass "it copies the experts the holder lacks: $(grep -ao 'the experts of layers [^(]*([0-9]* MiB' "$SUP_DIR/sup.log" | head -1))" \
  || fail "no own copy of the experts the holder lacks in the log"
url=$(sup_proxy_url)
name=$(sup_get 's["model"]["name"]')
before=$(gpu_complete "$url" "$name")
[[ ${before##*$'\n'} == 200 ]] && pass "served with every expert on the GPU" || fail "request: $before"

# 1.5 GiB left on the GPU: below min_available (2 GiB).
if ! gpu_take "$SUP_DIR/hog" $((3 * 2 ** 29)); then
  fail "the process taking GPU memory did not start"; kill "$HOG" 2>/dev/null; sup_finish
fi
hog=$HOG
if sup_wait 60 'w[0]["host_experts"] == 2 and w[0]["state"] == "ready"'; then
  [[ $(sup_get 'w[0]["context"]') == 512 ]] \
    && pass "GPU taken ($(cat "$SUP_DIR/hog")): the experts of 2 layers went to the host, context still 512" \
    || fail "the first step changed the context: $(sup_get 'w[0]["context"]')"
  answer=$(gpu_complete "$url" "$name")
  [[ ${answer##*$'\n'} == 200 ]] && pass "served with 2 layers' experts on the host" || fail "request: $answer"
  [[ $answer == "$before" ]] && echo "     (the same greedy answer as with every expert on the GPU)" \
    || echo "     (the greedy answer parted from the GPU's: the CPU's experts round differently; not asserted)"
  python3 -c 'import sys, urllib.request
sys.exit(0 if "ds4_worker_host_expert_layers{worker=\"0\"} 2" in urllib.request.urlopen(sys.argv[1]).read().decode() else 1)' \
    "$url/metrics" && pass "/metrics: ds4_worker_host_expert_layers 2" || fail "/metrics lacks the expert rung"
else
  fail "no expert rung with the GPU's memory taken: $(sup_status | tr -d '\n' | cut -c1-600)"
fi
if sup_wait 90 'w[0]["context"] == 256 and w[0]["host_experts"] == 4 and w[0]["state"] == "ready"'; then
  pass "past the last expert rung (4 layers) the context went down: 256 with 4 layers' experts on the host"
else
  fail "did not reach 256/e4: $(sup_status | tr -d '\n' | cut -c1-600)"
fi
[[ $(gpu_complete "$url" "$name") == *$'\n'200 ]] && pass "served at the smallest rung" || fail "no answer at the smallest rung"
path=$(sup_events | python3 -c '
import json, sys
ev = [e for e in json.load(sys.stdin)["events"] if e["event"] == "downgrade"]
print(" ".join("%s/e%s->%s/e%s" % (e["context_from"], e.get("host_experts_from"), e["context_to"],
                                   e.get("host_experts_to")) for e in ev))')
[[ $path == "512/e0->512/e2 512/e2->512/e4 512/e4->256/e4" ]] && pass "the downgrades, as decided: $path" \
  || fail "downgrade path: '$path'"
line=$("$DS4_BIN/ds4ctl" events | grep downgrade | head -1)
[[ $line == *"512/e0 -> 512/e2"* ]] && pass "ds4ctl events: ${line:0:160}" || fail "ds4ctl events: '$line'"
"$DS4_BIN/ds4ctl" status | grep -q 'experts on the host: the first 4 layers' && pass "ds4ctl status shows the expert rung" \
  || fail "ds4ctl status: $("$DS4_BIN/ds4ctl" status | tail -5)"

kill $hog; wait $hog 2>/dev/null
if sup_wait 120 'w[0]["context"] == 512 and w[0]["host_experts"] == 0 and w[0]["state"] == "ready"'; then
  path=$(sup_events | python3 -c '
import json, sys
ev = [e for e in json.load(sys.stdin)["events"] if e["event"] == "upgrade"]
print(" ".join("%s/e%s->%s/e%s" % (e["context_from"], e.get("host_experts_from"), e["context_to"],
                                   e.get("host_experts_to")) for e in ev))')
  [[ $path == "256/e4->512/e4 512/e4->512/e2 512/e2->512/e0" ]] \
    && pass "GPU memory back: up the same path, every expert on the GPU again ($path)" || fail "upgrade path: '$path'"
else
  fail "no way back up with the GPU's memory back: $(sup_status | tr -d '\n' | cut -c1-600)"
fi
again=$(gpu_complete "$url" "$name")
[[ $again == "$before" ]] && pass "the same greedy answer as at the start" || fail "answer after the round trip: $again vs $before"
sup_stop
sup_finish
