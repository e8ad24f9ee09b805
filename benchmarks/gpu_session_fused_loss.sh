#!/usr/bin/env bash
# Lent H100, 2026-11-26 (third and fourth calls): the chunked cross-entropy with torch's log-softmax on each slice
# (the keep-mask folded into the write of the gradient) against the upcast loss, on the same machine: correctness
# on CUDA first, then the 16k run of the 8B's layers and Llama 3.2 1B. Call 3 found CUDA's _log_softmax converts
# fp16 only (bf16 refused: the check failed, the chunked runs with it); call 4 ran the fix (the slice's fp32 copy).
# Data and the table: benchmarks/data/h100-2026-11-26c, benchmarks/chunked_loss_h100.py.
# Next lent GPU: run it again (WITH_UPCAST= to skip the twins): the executor now leaves autocast before the loss,
# so 8b4l-16k-chunked-eager should peak near its price (37.3 GiB, was 38.97: autocast's 1.6 GiB of weight copies).
#   run: python3 -m pip install ... --target /tmp/site .whl/*.whl .whl-tf/*.whl; DEADLINE=300 bash THIS
set -u
W=/tmp/gs5; DEADLINE=${DEADLINE:-300}
source benchmarks/gpu_lib.sh
step check 40 python3 -m benchmarks.gpu_cross_entropy_check; cat "$W/check.out"
ex() { step "$1" "$2" python3 -m soap execute "benchmarks/data/h100-2026-11-26/plans/$1.plan.json" --steps "$3" --report "$W/$1.run.json" --json; }
ex 8b4l-16k-chunked-eager 60 3
ex 1b-pick-chunked 70 8
[ -n "${WITH_UPCAST-1}" ] && { ex 1b-pick 65 8; ex 8b4l-16k-eager 55 3; }  # call 4 (WITH_UPCAST=) left these out
cat "$W/steps.txt"
