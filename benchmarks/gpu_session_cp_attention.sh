#!/usr/bin/env bash
# Lent H100 or H200, one call (session 26, 2026-11-27): (1) context parallelism's attention kernel per cp rank,
# as soap's executor runs it (a boolean mask over all gathered keys) against soap's price (the whole causal
# sequence / cp) and the layouts that skip masked blocks (`benchmarks/cp_attention.py`); (2) whether torchao's
# compiled float8 weight casts are paid once a micro-batch or once a step: the four Llama-3-8B layers at 1 x 8,192
# with 2 micro-batches, fp8 and bf16 (`benchmarks/fp8_casts.py` reads them beside the 1-micro-batch pair of
# benchmarks/data/h100-2026-11-27-kernels/, the -mb2 files).
#   run: python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl &&
#        export PYTHONPATH=/tmp/site:$PWD; DEADLINE=400 bash THIS [cp|fp8|cp,fp8]  (carry .whl: torchao 0.18.0)
set -u
W=/tmp/gs-cp; DEADLINE=${DEADLINE:-420}
source benchmarks/gpu_lib.sh
PARTS=${1:-cp,fp8}  # the first call ran both; the cp part faulted in one process for all layouts and ran again alone
if [[ $PARTS == *cp* ]]; then
CASES=8192:2,8192:4,32768:2,32768:4,65536:2,131072:4
for layout in whole whole-full executor lower-right-last lower-right-first zigzag; do  # one process each (a fault)
    step "cp-$layout" 60 python3 -m benchmarks.cp_attention --cases $CASES --layouts $layout --out "$W/cp-$layout.json"
done
python3 -m benchmarks.cp_attention --table "$W"/cp-*.json --out "$W/cp-attention.json"
fi
if [[ $PARTS == *fp8* ]]; then
CONFIG=benchmarks/configs/llama-3-8b-4l.json
step fp8 150 python3 -m benchmarks.gpu_step_profile $CONFIG 1 8192 --compile --fp8 --micro-batches 2 --json "$W/step-profile-compile-fp8-mb2.json"
head -3 "$W/fp8.out"
step bf16 150 python3 -m benchmarks.gpu_step_profile $CONFIG 1 8192 --compile --micro-batches 2 --json "$W/step-profile-compile-bf16-mb2.json"
head -3 "$W/bf16.out"
fi
cp "$W"/*.json "$OUT/" 2>/dev/null
cat "$W/steps.txt"
