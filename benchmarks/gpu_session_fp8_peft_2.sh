#!/usr/bin/env bash
# Lent H100, 2026-11-26 (session 19, second call): the first call (gpu_session_fp8_peft.sh) ran the autocast check and
# the compiled fp8/bf16 twins; LoRA and QLoRA outran 60 and 70 s without a line. Here LoRA runs with Python's
# faulthandler and, if still running at DUMP_AT s, its worker is sent SIGABRT so its stack shows where it waits;
# QLoRA runs with HF_HUB_OFFLINE=1 (a Hub call with no network would hang); then the eager fp8 and bf16 twins.
set -u
W=/tmp/gs7; DEADLINE=${DEADLINE:-300}; DUMP_AT=${DUMP_AT:-70}
source benchmarks/gpu_lib.sh
NEW=benchmarks/data/h100-2026-11-26d/plans
ex() { step "$1" "$2" python3 -m soap execute "$NEW/$1.plan.json" --steps "$3" --report "$W/$1.run.json" --json; }
t0=$SECONDS
PYTHONFAULTHANDLER=1 timeout -k 5 $((DUMP_AT + 15)) python3 -m soap execute $NEW/8b4l-lora.plan.json --steps 4 \
    --report "$W/8b4l-lora.run.json" --json >"$W/8b4l-lora.out" 2>"$W/8b4l-lora.err" &
pid=$!
while kill -0 $pid 2>/dev/null && [ $((SECONDS - t0)) -lt "$DUMP_AT" ]; do sleep 1; done
if kill -0 $pid 2>/dev/null; then
  ps -eo pid,etimes,pcpu,rss,args | grep -v grep | grep -E "spawn_main|soap" | cut -c1-200 >"$W/8b4l-lora.ps"
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv >>"$W/8b4l-lora.ps"
  pkill -ABRT -f spawn_main; sleep 4
fi
wait $pid; echo "8b4l-lora rc=$? $((SECONDS - t0))s (dump at $DUMP_AT)" | tee -a "$W/steps.txt"
cat "$W/8b4l-lora.ps" 2>/dev/null; for f in /tmp/soap-workers-*/*; do [ -f "$f" ] && cp "$f" "$W/lora-worker-$(basename "$f")"; done
grep -v SyntaxWarning "$W/8b4l-lora.err" | grep -v '"""' | tail -40; tail -3 "$W/8b4l-lora.out"
export HF_HUB_OFFLINE=1
ex 8b4l-qlora 80 4
tail -4 "$W/8b4l-qlora.out"
ex 8b4l-eager-fp8 55 6
ex 8b4l-eager-bf16 45 6
cat "$W/steps.txt"
