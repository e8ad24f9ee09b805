#!/usr/bin/env bash
# One lent H100 call: LoRA and QLoRA (peft, bitsandbytes NF4) measured against their prices.
# - On four Llama-3-8B layers at 8192 tokens, with the full fine-tuning twin planned with the same pins (micro-batch 1,
#   2 micro-batches, no recompute, eager, chunked loss): what LoRA saves in time and memory, measured and priced.
#   gpu_session_fp8_peft*.sh (2026-11-26) lost both to the CPU init of their bf16 base; the seeded init now draws in
#   fp32 and rounds (executor.model.SeededInit).
# - The plan soap picks for the whole Llama-3-8B on one GPU with LoRA and with QLoRA (`soap plan llama-3-8b --gpus 1
#   --peft lora --global-batch 8`), then the GPU-marked tests (QLoRA trains on a GPU; the autocast checks).
# Ran 2026-11-27 on a lent H100: the two picks outran 85 s here, their seeded init alone ~100 s on the CPU, and
# ran alone after it (limits now 180 s); data and table: benchmarks/peft_h100.py.
# Plans were made on a CPU machine (torch 2.13; the device's torch 2.11 cannot trace GQA), in
# benchmarks/data/h100-2026-11-27/plans.
# Carried: .whl (pydantic, pydantic_core, annotated-types, typing-inspection, transformers 5.24 and peft 0.21.2, the
# versions the plans were made with) and .sitepeft (bitsandbytes 0.50.2 with its CUDA 13.0 library alone):
#   run: python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl &&
#        export PYTHONPATH=/tmp/site:$PWD/.sitepeft:$PWD; DEADLINE=540 bash THIS
set -u
W=/tmp/gs9; DEADLINE=${DEADLINE:-540}
source benchmarks/gpu_lib.sh
export HF_HUB_OFFLINE=1
peft_versions
PLANS=benchmarks/data/h100-2026-11-27/plans
ex() { execute "$1" "$2" "$PLANS" "$3"; }
ex 8b4l-lora 70 5
ex 8b4l-qlora 75 5
ex 8b4l-eager-bf16 60 5
ex 8b-lora-pick 180 3
ex 8b-qlora-pick 180 3
step pytest-gpu 60 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header tests/test_peft_execute.py \
    tests/test_autocast_gpu.py
tail -3 "$W/pytest-gpu.out"
cat "$W/steps.txt"
