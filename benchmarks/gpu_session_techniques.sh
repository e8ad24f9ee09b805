#!/usr/bin/env bash
# One lent GPU call (2026-11-28, an H200): the single-GPU techniques no soap run had executed on a GPU, against their
# prices. Llama 3.2 1B at 16 x 2,048 tokens a step, every plan pinned alike (micro-batch 4, 4 micro-batches, no
# recompute, eager, chunked loss) on the default `dgx-h200` and one pin changed: the AdamW baseline, fp16 (GradScaler)
# and tf32 against bf16, the optimizer offloaded to the CPU, bitsandbytes' 8-bit AdamW, Adafactor and SGD; then the
# GPU-marked tests (context parallelism's kernels, autocast, QLoRA, validation). Data and table:
# benchmarks/techniques_h200.py.
# Plans were made on a CPU machine (torch 2.13; the device's torch 2.11 cannot trace GQA), in
# benchmarks/data/h200-2026-11-28/plans.
# Carried: .whl (pydantic, pydantic_core, annotated-types, typing-inspection, transformers 5.24 and peft 0.21.2, the
# versions the plans were made with) and .sitepeft (bitsandbytes 0.50.2 with its CUDA 13.0 library alone):
#   run: python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl &&
#        export PYTHONPATH=/tmp/site:$PWD/.sitepeft:$PWD; DEADLINE=430 bash THIS
set -u
W=/tmp/gs-tech; DEADLINE=${DEADLINE:-430}
source benchmarks/gpu_lib.sh
export HF_HUB_OFFLINE=1
peft_versions
PLANS=benchmarks/data/h200-2026-11-28/plans
ex() { execute "$1" "$2" "$PLANS" "$3"; }
# the first call ran all; 1b-offload failed (FSDP's CPUOffloadPolicy refused parameters materialized on the GPU,
# fixed in executor.api.parameter_device) and 1b-sgd ran out of time; the second call (`bash THIS 1b-offload
# pytest-offload 1b-sgd`) ran SGD, but the offload run outran its 90 s (now 180) without a step and the test's
# subprocesses lacked the carried packages (fixed). Next: `DEADLINE=300 bash THIS 1b-offload pytest-offload`
PARTS=${*:-1b-adamw 1b-fp16 1b-tf32 1b-offload 1b-adamw8bit 1b-adafactor pytest-gpu 1b-sgd}
for part in $PARTS; do
    case $part in
    1b-offload) ex 1b-offload 180 4 ;;
    pytest-gpu) step pytest-gpu 90 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header \
        tests/test_context_parallel.py tests/test_autocast_gpu.py tests/test_peft_execute.py tests/test_validation.py \
        tests/test_step_factor.py; tail -3 "$W/pytest-gpu.out" ;;
    pytest-offload) step pytest-offload 90 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header \
        tests/test_executor_cli.py -k offload; tail -3 "$W/pytest-offload.out" ;;
    *) ex "$part" 60 6 ;;
    esac
done
cat "$W/steps.txt"
