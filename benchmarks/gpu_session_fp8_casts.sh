#!/usr/bin/env bash
# Lent H100 or H200, one call (session 25, 2026-11-27): where a compiled fp8 step's extra memory-bound time goes.
# soap counts torchao's compiled float8 casts as two fused kernels (an amax, a scaled cast) and then also applies
# the device's compile factor to them (`costmodel.opcost._cast_time`); dropping the factor fitted the corpus worse
# (benchmarks/fp8_h100.py's reading). torch.profiler over one step of four Llama-3-8B layers (8,192 tokens),
# compiled, with torchao's float8 Linears and without, lists every kernel: the memory-bound kernels the fp8 step
# adds over its bf16 twin are the casts as Inductor emits them (`benchmarks/fp8_casts.py` reads the files).
#   run: python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl &&
#        export PYTHONPATH=/tmp/site:$PWD; DEADLINE=330 bash THIS [CONFIG BATCH SEQ SUFFIX]  (carry .whl: torchao 0.18.0)
# Default: the 8B's four layers at 1 x 8,192 (files step-profile-compile-{fp8,bf16}.json); a second call profiled
# Llama 3.2 1B at 4 x 4,096 (`... benchmarks/configs/llama-3.2-1b.json 4 4096 -1b`).
set -u
W=/tmp/gs-fp8casts; DEADLINE=${DEADLINE:-330}
source benchmarks/gpu_lib.sh
CONFIG=${1:-benchmarks/configs/llama-3-8b-4l.json} BATCH=${2:-1} SEQ=${3:-8192} SUFFIX=${4:-}
step fp8 150 python3 -m benchmarks.gpu_step_profile "$CONFIG" "$BATCH" "$SEQ" --compile --fp8 --json "$W/step-profile-compile-fp8$SUFFIX.json"
head -3 "$W/fp8.out"
step bf16 150 python3 -m benchmarks.gpu_step_profile "$CONFIG" "$BATCH" "$SEQ" --compile --json "$W/step-profile-compile-bf16$SUFFIX.json"
head -3 "$W/bf16.out"
cp "$W"/step-profile-*.json "$OUT/" 2>/dev/null
cat "$W/steps.txt"
