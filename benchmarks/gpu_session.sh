#!/usr/bin/env bash
# One lent GPU, one call: calibrate it (kernels, optimizer, compile chains, a training step's factor), profile
# where a step of the 8B's layers goes eager and compiled, run soap's single-GPU suite and planner-chosen plans on
# it against their predictions, and the GPU-marked tests. Everything lands in $OUT/session.tgz (the device tool returns
# at most 8 files); `benchmarks/gpu_execute.py --record` and `gpu_validate`-style readers take it from there.
#
#   run: python3 -m pip install ... --target /tmp/site .whl/*.whl; bash benchmarks/gpu_session.sh NAME
#
# NAME is the measured profile's name (h200-x1-measured). Steps and their limits: benchmarks/gpu_lib.sh.
set -u
NAME=${1:-local-cuda}
DATASHEET=${2:-dgx-h200}
W=/tmp/gpu-session
source "$(dirname "$0")/gpu_lib.sh"
step calibrate 230 python3 -m soap calibrate --device cuda --nproc 1 --name "$NAME" -o "$W/$NAME.json" --json
[ -s "$W/$NAME.json" ] || step calibrate-quick 60 python3 -m soap calibrate --device cuda --nproc 1 --quick --name "$NAME" -o "$W/$NAME.json" --json
MEASURED="$W/$NAME.json"
[ -s "$MEASURED" ] || MEASURED=$DATASHEET
P8B=benchmarks/configs/llama-3-8b-4l.json  # the 8B's layers on one GPU: where a step goes, eager and compiled
step profile-eager 90 python3 -m benchmarks.gpu_step_profile "$P8B" 1 8192 --json "$W/step-profile-eager.json"
step profile-compile 150 python3 -m benchmarks.gpu_step_profile "$P8B" 1 8192 --compile --json "$W/step-profile-compile.json"
step validate 110 python3 -m soap validate --device cuda --nproc 1 --cluster "$MEASURED" --runs-log "$W/runs.jsonl" --json
step execute-bf16 120 python3 -m benchmarks.gpu_execute --out "$W/bf16" --clusters "$DATASHEET" "$MEASURED"
step execute-fp8 60 python3 -m benchmarks.gpu_execute --out "$W/fp8" --clusters "$DATASHEET" --precisions fp8
step pytest-gpu 45 python3 -m pytest -q -m gpu -p no:cacheprovider -x --no-header tests/test_autocast_gpu.py tests/test_validation.py tests/test_calibration.py
cat "$W/steps.txt"
