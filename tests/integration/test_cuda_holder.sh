#!/usr/bin/env bash
# The CUDA weights holder with the real daemons (skips without a GPU): two
# workers share one copy of the weights on the device, a killed worker is back
# in under a second, workers outlive the holder, the next one falls back to a copy.
exec python3 "$(dirname "$0")/cuda_holder_test.py"
