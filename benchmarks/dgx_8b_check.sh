#!/usr/bin/env bash
# On one node of 8 H100 (a DGX/HGX H100, 700 W): does soap's executor on llama-3-8b run at the default
# profile's prediction (`dgx-h100`, about 47% MFU) or at the measured H100's (about 68%)? Plans the 8B the way
# soap picks it (compiled) and eagerly, executes each for a few steps, then re-predicts both runs with either
# profile's compute terms (benchmarks/profile_choice.py). About 10 minutes.
#
#   bash benchmarks/dgx_8b_check.sh [OUT_DIR]          # on the node, from the repository root
#
# The global batch is 64 x 4,096 tokens (a step of seconds, not the default 4M-token minute).
set -eu
OUT=${1:-dgx-8b-check}
mkdir -p "$OUT"
export SOAP_RUNS_LOG="$OUT/runs.jsonl"
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv >"$OUT/env.txt"
for mode in compile no-compile; do
    python3 -m soap plan llama-3-8b --gpus 8 --cluster dgx-h100 --seq-len 4096 --global-batch 64 --$mode \
        -o "$OUT/8b-$mode.plan.json"
    python3 -m soap execute "$OUT/8b-$mode.plan.json" --steps 12 --report "$OUT/8b-$mode.run.json"
done
python3 -m benchmarks.profile_choice "$SOAP_RUNS_LOG" --cluster dgx-h100 | tee "$OUT/profile-choice.md"
