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
DEADLINE=${DEADLINE:-540}
W=/tmp/gs
source "$(dirname "$0")/gpu_lib.sh"
ex() { step "$1" "$2" python3 -m soap execute "benchmarks/data/h100-2026-11-26/plans/$1.plan.json" --steps "$3" --report "$W/$1.run.json" --json; }
ex 8b4l-eager 70 6
ex 8b4l-compile 100 8
step calibrate 240 python3 -m soap calibrate --device cuda --nproc 1 --name h100-x1-measured -o "$W/h100-x1-measured.json" --json
ex 8b4l-16k 90 8
ex 1b-pick 75 8
ex 8b4l-eager-full 60 6
ex 1b-eager 60 6
cat "$W/steps.txt"
