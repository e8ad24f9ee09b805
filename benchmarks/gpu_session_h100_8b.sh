#!/usr/bin/env bash
# One lent H100, one call (2026-11-26): soap's executor on 8B-shaped layers (eager, compiled, recompute, 16k
# context) and Llama 3.2 1B against the predictions made on the CPU (plans traced with torch 2.13 there: the
# device's torch 2.11 cannot trace GQA), then `soap calibrate --device cuda` (long-context SDPA, compile chains at
# training sizes). Each step has a time limit and the whole script a deadline. The plans, made here with
#   soap plan benchmarks/configs/llama-3-8b-4l.json --gpus 1 --global-batch 2 --seq-len 8192 --micro-batch 1 \
#        [--no-compile | --compile | --no-compile --recompute full]          (8b4l-eager, -compile, -eager-full)
#   soap plan benchmarks/configs/llama-3-8b-4l.json --gpus 1 --global-batch 1 --seq-len 16384      (8b4l-16k)
#   soap plan benchmarks/configs/llama-3.2-1b.json --gpus 1 --global-batch 16 --seq-len 2048 [--no-compile]
# are in benchmarks/data/h100-2026-11-26/plans; the results landed there too (benchmarks/h100_measured.py).
#   run: python3 -m pip install ... --target /tmp/site .whl/*.whl .whl-tf/*.whl; bash benchmarks/gpu_session_h100_8b.sh
set -u
T0=$SECONDS; DEADLINE=${DEADLINE:-540}
W=/tmp/gs; mkdir -p "$W"
export PYTHONUNBUFFERED=1 SOAP_PROFILES_DIR="$W/profiles" SOAP_RUNS_LOG="$W/runs.jsonl"
pack() { tar czf "$OUT/session.tgz" -C "$W" . 2>/dev/null; cp "$W/steps.txt" "$OUT/" 2>/dev/null; }
trap pack EXIT
step() {  # step LABEL SECONDS COMMAND...
    local label=$1 limit=$2; shift 2
    local left=$((DEADLINE - (SECONDS - T0)))
    [ "$left" -lt 25 ] && { echo "$label skipped (no time)" | tee -a "$W/steps.txt"; return; }
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" >"$W/$label.out" 2>"$W/$label.err"
    local rc=$?
    echo "$label rc=$rc $((SECONDS - t0))s (limit $limit)" | tee -a "$W/steps.txt"
    tail -4 "$W/$label.err"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  python3 -c "import torch, transformers, pydantic, ortools; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
  nproc; free -g | head -2; } >"$W/env.txt" 2>&1
cat "$W/env.txt"
ex() { step "$1" "$2" python3 -m soap execute "benchmarks/data/h100-2026-11-26/plans/$1.plan.json" --steps "$3" --report "$W/$1.run.json" --json; }
ex 8b4l-eager 70 6
ex 8b4l-compile 100 8
step calibrate 240 python3 -m soap calibrate --device cuda --nproc 1 --name h100-x1-measured -o "$W/h100-x1-measured.json" --json
ex 8b4l-16k 90 8
ex 1b-pick 75 8
ex 8b4l-eager-full 60 6
ex 1b-eager 60 6
cat "$W/steps.txt"
