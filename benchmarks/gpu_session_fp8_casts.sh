#!/usr/bin/env bash
# Lent H100 or H200, one call (session 25, 2026-11-27): where a compiled fp8 step's extra memory-bound time goes.
# soap counts torchao's compiled float8 casts as two fused kernels (an amax, a scaled cast) and then also applies
# the device's compile factor to them (`costmodel.opcost._cast_time`); dropping the factor fitted the corpus worse
# (benchmarks/fp8_h100.py's reading). torch.profiler over one step of four Llama-3-8B layers (8,192 tokens),
# compiled, with torchao's float8 Linears and without, lists every kernel: the memory-bound kernels the fp8 step
# adds over its bf16 twin are the casts as Inductor emits them (`benchmarks/fp8_casts.py` reads the two files).
#   run: python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl &&
#        export PYTHONPATH=/tmp/site:$PWD; DEADLINE=330 bash THIS       (carry .whl: torchao 0.18.0 among it)
set -u
W=/tmp/gs-fp8casts; DEADLINE=${DEADLINE:-330}
source benchmarks/gpu_lib.sh
P8B=benchmarks/configs/llama-3-8b-4l.json
step fp8 150 python3 -m benchmarks.gpu_step_profile "$P8B" 1 8192 --compile --fp8 --json "$W/step-profile-compile-fp8.json"
head -3 "$W/fp8.out"
step bf16 150 python3 -m benchmarks.gpu_step_profile "$P8B" 1 8192 --compile --json "$W/step-profile-compile-bf16.json"
head -3 "$W/bf16.out"
cp "$W"/step-profile-*.json "$OUT/" 2>/dev/null
cat "$W/steps.txt"
