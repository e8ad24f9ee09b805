#!/usr/bin/env bash
# One lent GPU call (2026-11-28, second session): what the techniques call of the same day left. (1) Which attention
# kernel a tf32 plan runs and its time (benchmarks/sdpa_fp32.py), and one profiled tf32 step of the Llama 3.2 1B plan
# beside its bf16 twin (benchmarks/gpu_step_profile.py: kernel groups), against the tf32 step priced 2x fast;
# (2) the optimizer-offload plan, which had failed (fixed in executor.api.parameter_device) and then outran 90 s,
# with its GPU-marked test; (3) second call: the host's AdamW, foreach against fused (benchmarks/host_adamw.py), and
# the offload plan again with the executor's AdamW fused on the host too (`bash THIS host-adamw 1b-offload-fused
# pytest-offload`, the test given 200 s: the first call's 90 s ran only its llama case); (4) third call: the
# offload plan at 1 and 2 micro-batches (`bash THIS 1b-offload-ga1 1b-offload-ga2`, plans in
# benchmarks/data/h200-2026-11-28b). Results: benchmarks/data/h200-2026-11-28b, benchmarks/offload_h200.py.
# Plans: benchmarks/data/h200-2026-11-28/plans (made on a CPU machine).
# Carried: .whl and .sitepeft as in gpu_session_techniques.sh:
#   run: python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl &&
#        export PYTHONPATH=/tmp/site:$PWD/.sitepeft:$PWD; DEADLINE=470 bash THIS
set -u
W=/tmp/gs-tf32; DEADLINE=${DEADLINE:-470}
source benchmarks/gpu_lib.sh
export HF_HUB_OFFLINE=1
PLANS=benchmarks/data/h200-2026-11-28/plans
CONFIG=benchmarks/configs/llama-3.2-1b.json
PARTS=${*:-sdpa tf32-profile 1b-offload pytest-offload bf16-profile}
for part in $PARTS; do
    case $part in
    sdpa) step sdpa 80 python3 -m benchmarks.sdpa_fp32 --json "$W/sdpa-fp32.json" ;;
    tf32-profile) step tf32-profile 100 python3 -m benchmarks.gpu_step_profile "$CONFIG" 4 2048 --micro-batches 4 \
        --precision tf32 --json "$W/step-profile-1b-tf32.json"; head -3 "$W/tf32-profile.out" ;;
    bf16-profile) step bf16-profile 70 python3 -m benchmarks.gpu_step_profile "$CONFIG" 4 2048 --micro-batches 4 \
        --json "$W/step-profile-1b-bf16.json"; head -3 "$W/bf16-profile.out" ;;
    1b-offload) execute 1b-offload 170 "$PLANS" 3; tail -5 "$W/1b-offload.err" ;;
    1b-offload-fused) step 1b-offload-fused 150 python3 -m soap execute "$PLANS/1b-offload.plan.json" --steps 3 \
        --report "$W/1b-offload-fused.run.json" --json; tail -5 "$W/1b-offload-fused.err" ;;
    1b-offload-ga1|1b-offload-ga2) execute "$part" 75 benchmarks/data/h200-2026-11-28b 3; tail -3 "$W/$part.err" ;;
    host-adamw) step host-adamw 90 python3 -m benchmarks.host_adamw --json "$W/host-adamw.json"
        cat "$W/host-adamw.out" ;;
    pytest-offload) step pytest-offload 200 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header \
        tests/test_executor_cli.py -k offload; tail -3 "$W/pytest-offload.out" ;;
    esac
done
cat "$W/steps.txt"
