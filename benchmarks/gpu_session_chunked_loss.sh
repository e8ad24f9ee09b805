#!/usr/bin/env bash
# For the next lent GPU: the chunked cross-entropy (executor.cross_entropy) against the upcast one on the 16k run of
# four Llama-3-8B layers (selective recompute, eager and compiled), each with a memory snapshot of its second step.
# On CPU (2026-11-26) soap prices the upcast eager step at 52.5 GiB and the chunked at 37.8 GiB, both 523 ms; the
# upcast run measured 50.5 GiB on an H100 (23.5 GiB of it the loss's three fp32 logits-sized tensors).
#   run: python3 -m pip install ... --target /tmp/site .whl/*.whl .whl-tf/*.whl; DEADLINE=300 bash THIS
# Ran on the lent H100 of 2026-11-26 (call 1); data in benchmarks/data/h100-2026-11-26c (inplace-*, call1-*).
set -u
W=/tmp/gs3; DEADLINE=${DEADLINE:-330}
source benchmarks/gpu_lib.sh
snap() { step "$1" "$2" python3 -m soap execute "benchmarks/data/h100-2026-11-26/plans/$1.plan.json" --steps "$3" --report "$W/$1.run.json" --memory-snapshot "$W/snap-$1" --json
  [ -s "$W/snap-$1/rank0.pickle" ] && python3 -m benchmarks.memory_snapshot_peak "$W/snap-$1/rank0.pickle" --json "$W/$1.peak.json" > "$W/$1.peak.txt" 2>&1
  cat "$W/$1.peak.txt" 2>/dev/null | head -30
  rm -rf "$W/snap-$1"; }
snap 8b4l-16k-chunked-eager 70 3
snap 8b4l-16k-eager 70 3
snap 8b4l-16k-chunked 100 4
cat "$W/steps.txt"
