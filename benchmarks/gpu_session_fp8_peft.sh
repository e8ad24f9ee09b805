#!/usr/bin/env bash
# Lent H100, 2026-11-26 (session 19, one call): what no GPU had run yet, each beside its bf16 twin on the same machine.
# - The executor leaving autocast before the loss (session 18): 8b4l-16k-chunked-eager should peak near its price
#   (37.3 GiB; 38.97 before, autocast's 1.6 GiB of cached weight copies), and 1b-pick-chunked likewise.
# - fp8 (torchao float8 on the blocks' nn.Linear) on four Llama-3-8B layers, compiled and eager, against bf16 twins
#   planned with the same pins (8192 tokens, micro-batch 1, no recompute).
# - LoRA and QLoRA (peft, bitsandbytes NF4) on the same layers.
# Plans were made here with torch 2.13 (`soap plan benchmarks/configs/llama-3-8b-4l.json --gpus 1 --seq-len 8192
# --global-batch 2 --micro-batch 1 --recompute none ...`): the device's torch 2.11 cannot trace GQA.
# peft, accelerate, psutil and bitsandbytes (its CUDA 13.0 library alone) travel in .sitepeft (carried).
# Data and the table: benchmarks/data/h100-2026-11-26d, benchmarks/fp8_peft_h100.py.
set -u
W=/tmp/gs6; DEADLINE=${DEADLINE:-380}
source benchmarks/gpu_lib.sh
python3 -c "import peft, bitsandbytes; print('peft', peft.__version__, 'bitsandbytes', bitsandbytes.__version__)" >>"$W/env.txt" 2>&1
tail -1 "$W/env.txt"
ex() { step "$1" "$2" python3 -m soap execute "$3/$1.plan.json" --steps "$4" --report "$W/$1.run.json" --json; }
OLD=benchmarks/data/h100-2026-11-26/plans NEW=benchmarks/data/h100-2026-11-26d/plans
ex 8b4l-16k-chunked-eager 60 $OLD 3
ex 8b4l-compile-bf16 100 $NEW 8
ex 8b4l-compile-fp8 100 $NEW 8
ex 8b4l-lora 60 $NEW 6
ex 8b4l-qlora 70 $NEW 6
ex 8b4l-eager-fp8 60 $NEW 6
ex 8b4l-eager-bf16 60 $NEW 6
ex 1b-pick-chunked 70 $OLD 8
cat "$W/steps.txt"
