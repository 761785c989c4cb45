#!/usr/bin/env bash
# How long a worker takes to be ready again when the model is already in
# shared memory (attach + plan + reserve + listen), for stories260K and a
# ~1 GB synthetic model, against a cold load of the same model. Prints the
# attach part separately: it must not grow with the model's size.
#   bench/restart.sh [RUNS=5]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
bin=${DS4_BIN:-build/bin}
models=${DS4_MODELS:-../shared/models}
mkdir -p build/models
big=build/models/1g-f16.gguf
[ -f "$big" ] || "$bin/ds4-mkmodel" --out "$big" --vocab-from "$models/stories260K.gguf" \
  --dim 2048 --layers 10 --ff 5632 --heads 16 --type f16 >&2
DS4_BIN="$bin" DS4_MODELS="$models" python3 - "$runs" "$models/stories260K.gguf" "$big" <<'PY'
import os, re, statistics, subprocess, sys, time
sys.path.insert(0, "tests/integration/lib")
from ds4test import Daemon, load_segment, BIN
runs = int(sys.argv[1])
for model in sys.argv[2:]:
    seg = load_segment(model)
    size = os.path.getsize(f"/dev/shm/{seg}")
    times, attach = [], []
    for _ in range(runs):
        d = Daemon(seg, context=512, slots=1)
        times.append(d.ready_after * 1000)
        d.stop()
        m = re.search(r"attached model segment \S+ in ([0-9.]+) ms", d.output())
        attach.append(float(m.group(1)) if m else float("nan"))
    # Cold: remove the segment and load it again from the file.
    subprocess.run([os.path.join(BIN, "ds4-worker"), "unload", "--segment", seg], capture_output=True)
    t0 = time.time()
    load_segment(model)
    cold = (time.time() - t0) * 1000
    med = statistics.median(times)
    print(f"{os.path.basename(model)}: segment {size/2**20:.0f} MiB; worker ready after restart "
          f"median {med:.1f} ms (min {min(times):.1f}, max {max(times):.1f}), of which attaching the segment "
          f"{statistics.median(attach):.1f} ms (the rest: process start, touching KV and scratch); cold load into shared memory "
          f"{cold:.0f} ms = {cold/med:.0f}x the restart")
PY
