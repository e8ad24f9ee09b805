#!/usr/bin/env bash
# One lent GPU, one call: profile where a step of the 8B's layers goes (eager and compiled: the evidence
# benchmarks/h100_measured.py and h200_measured.py solve the step and compile factors from), run soap's executor on
# plans made beforehand on a CPU machine (the GPU image's torch cannot trace GQA models), then calibrate the GPU
# (kernels, optimizer, compile chains, a reference step's factor) and run the planner-chosen single-GPU suite on
# the new profile and the GPU-marked tests. The cheap steps come first: on the second lent H200 (2026-11-26) the
# full calibrate alone outran 230 s. Everything lands in $OUT/session.tgz (the device tool returns at most 8 files).
#
#   run: python3 -m pip install ... --target /tmp/site .whl/*.whl .whl-tf/*.whl; DEADLINE=520 bash benchmarks/gpu_session.sh NAME DATASHEET
#
# NAME is the measured profile's name (h200-x1-measured), DATASHEET the cluster it is compared with (dgx-h200).
# Steps and their limits: benchmarks/gpu_lib.sh.
set -u
NAME=${1:-local-cuda}
DATASHEET=${2:-dgx-h200}
W=/tmp/gpu-session
PLANS=benchmarks/data/h100-2026-11-26/plans
source "$(dirname "$0")/gpu_lib.sh"
P8B=benchmarks/configs/llama-3-8b-4l.json  # the 8B's layers on one GPU: where a step goes, eager and compiled
step profile-eager 90 python3 -m benchmarks.gpu_step_profile "$P8B" 1 8192 --json "$W/step-profile-eager.json"
step profile-compile 150 python3 -m benchmarks.gpu_step_profile "$P8B" 1 8192 --compile --json "$W/step-profile-compile.json"
for run in 8b4l-eager:6 8b4l-compile:8 1b-pick:6; do
  step "${run%:*}" 90 python3 -m soap execute "$PLANS/${run%:*}.plan.json" --steps "${run#*:}" --report "$W/${run%:*}.run.json" --json
done
# without -o, calibrate writes the device to $SOAP_PROFILES_DIR/devices/NAME.json, where --cluster finds it first
step calibrate 330 python3 -m soap calibrate --device cuda --nproc 1 --name "$NAME" --json
MEASURED=$DATASHEET
if [ -s "$SOAP_PROFILES_DIR/devices/$NAME.json" ]; then
  # a one-GPU cluster around it: the shipped one of that name, else the datasheet cluster's links
  python3 -c "import json, sys; from pathlib import Path; name, sheet, out = sys.argv[1:]
shipped = Path('profiles/clusters') / f'{name}.json'
c = json.loads((shipped if shipped.exists() else Path('profiles/clusters') / f'{sheet}.json').read_text())
c.update(name=name, device=name, gpus_per_node=1); Path(out).mkdir(parents=True, exist_ok=True)
(Path(out) / f'{name}.json').write_text(json.dumps(c, indent=2))" "$NAME" "$DATASHEET" "$SOAP_PROFILES_DIR/clusters" && MEASURED=$NAME
fi
step validate 110 python3 -m soap validate --device cuda --nproc 1 --cluster "$MEASURED" --runs-log "$W/runs.jsonl" --json
step execute-bf16 120 python3 -m benchmarks.gpu_execute --out "$W/bf16" --clusters "$DATASHEET" "$MEASURED"
step pytest-gpu 45 python3 -m pytest -q -m gpu -p no:cacheprovider -x --no-header tests/test_autocast_gpu.py tests/test_validation.py tests/test_calibration.py
cat "$W/steps.txt"
