#!/usr/bin/env bash
# Lent H100, 2026-11-26 (third call): does the chunked cross-entropy's extra pass over the logits, seen on the 16k
# run of the 8B's layers (+17 ms a step eager, +18 compiled), carry over to Llama 3.2 1B at 4 x 2048 tokens a
# micro-batch (4 micro-batches)? Each chunked run beside its upcast twin on the same machine.
#   run: python3 -m pip install ... --target /tmp/site .whl/*.whl .whl-tf/*.whl; DEADLINE=270 bash THIS
set -u
W=/tmp/gs4; DEADLINE=${DEADLINE:-270}
source benchmarks/gpu_lib.sh
ex() { step "$1" "$2" python3 -m soap execute "benchmarks/data/h100-2026-11-26/plans/$1.plan.json" --steps "$3" --report "$W/$1.run.json" --json; tail -3 "$W/$1.err"; }
ex 1b-pick-chunked 75 8
ex 1b-pick 75 8
ex 1b-eager-chunked 60 6
ex 1b-eager 60 6
cat "$W/steps.txt"
