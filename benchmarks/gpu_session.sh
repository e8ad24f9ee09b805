#!/usr/bin/env bash
# One lent GPU, one call: calibrate it, run soap's single-GPU suite and planner-chosen plans on it against
# their predictions, and the GPU-marked tests. Everything lands in $OUT/session.tgz (the device tool returns
# at most 8 files); `benchmarks/gpu_execute.py --record` and `gpu_validate`-style readers take it from there.
#
#   run: python3 -m pip install ... --target /tmp/site .whl/*.whl; bash benchmarks/gpu_session.sh NAME
#
# NAME is the measured profile's name (h200-x1-measured). Each step has its own time limit so that a slow one
# cannot take the others' results with it; the step times are in steps.txt.
set -u
NAME=${1:-local-cuda}
DATASHEET=${2:-dgx-h200}
W=/tmp/gpu-session
mkdir -p "$W"
export PYTHONUNBUFFERED=1 SOAP_PROFILES_DIR="$W/profiles" SOAP_RUNS_LOG="$W/runs.jsonl"
pack() { tar czf "$OUT/session.tgz" -C "$W" . 2>/dev/null; cp "$W/steps.txt" "$OUT/" 2>/dev/null; }
trap pack EXIT
step() {  # step LABEL SECONDS COMMAND...
    local label=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" >"$W/$label.out" 2>"$W/$label.err"
    local rc=$?
    echo "$label rc=$rc $((SECONDS - t0))s" | tee -a "$W/steps.txt"
    tail -3 "$W/$label.err"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  python3 -c "import torch, transformers, pydantic, ortools; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)"
  python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
  nproc; free -g | head -2; } >"$W/env.txt" 2>&1
cat "$W/env.txt"
step calibrate 230 python3 -m soap calibrate --device cuda --nproc 1 --name "$NAME" -o "$W/$NAME.json" --json
[ -s "$W/$NAME.json" ] || step calibrate-quick 60 python3 -m soap calibrate --device cuda --nproc 1 --quick --name "$NAME" -o "$W/$NAME.json" --json
MEASURED="$W/$NAME.json"
[ -s "$MEASURED" ] || MEASURED=$DATASHEET
step validate 110 python3 -m soap validate --device cuda --nproc 1 --cluster "$MEASURED" --runs-log "$W/runs.jsonl" --json
step execute-bf16 120 python3 -m benchmarks.gpu_execute --out "$W/bf16" --clusters "$DATASHEET" "$MEASURED"
step execute-fp8 60 python3 -m benchmarks.gpu_execute --out "$W/fp8" --clusters "$DATASHEET" --precisions fp8
step pytest-gpu 45 python3 -m pytest -q -m gpu -p no:cacheprovider -x --no-header tests/test_autocast_gpu.py tests/test_validation.py tests/test_calibration.py
cat "$W/steps.txt"
