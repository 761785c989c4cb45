#!/usr/bin/env bash
# The zero-loss test (test_proxy_zero_loss.sh: 300 requests through the SDKs,
# the worker SIGKILLed 3 times and OOM-killed once by the kernel, every answer
# identical to the undisturbed run's) on a mixture of experts: a qwen3moe
# that ds4-mkmodel writes with stories260K's vocabulary and KV geometry
# (5 layers, 4 KV heads of 8: the same memory ladder), 8 experts of which
# each token takes 2. Environment: as test_proxy_zero_loss.sh.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=${DS4_SRC:-$(cd "$here/../.." && pwd)}
models=${DS4_MODELS:-$src/../shared/models}
[[ -f $models/stories260K.gguf ]] || { echo "SKIP: no $models/stories260K.gguf"; exit 77; }
[[ -x ${DS4_BIN:-}/ds4-mkmodel ]] || { echo "FAIL: DS4_BIN must hold ds4-mkmodel"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$DS4_BIN/ds4-mkmodel" --out "$tmp/moe.gguf" --vocab-from "$models/stories260K.gguf" --arch qwen3moe --dim 64 \
  --layers 5 --ff 172 --heads 8 --kv-heads 4 --experts 8 --experts-used 2 --expert-ff 64 --ctx 2048 --seed 3 \
  --eos-bias 0.5 2>"$tmp/mk.log" || { cat "$tmp/mk.log"; echo "FAIL: ds4-mkmodel"; exit 1; }
DS4_ZERO_LOSS_MODEL=$tmp/moe.gguf bash "$here/test_proxy_zero_loss.sh"
