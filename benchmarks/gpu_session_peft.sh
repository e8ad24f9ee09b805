#!/usr/bin/env bash
# Prepared for the next lent GPU (written 2026-11-26): what gpu_session_fp8_peft.sh could not finish.
# - LoRA and QLoRA on four Llama-3-8B layers (peft, bitsandbytes NF4): both outlasted their limit initializing the
#   bf16 base on the CPU (call 2's faulthandler stack); the seeded init now draws in fp32 and rounds
#   (executor.model.SeededInit). Expect each to start as fast as the bf16 run of the same layers.
# - The eager bf16 twin of 8b4l-eager-fp8 with the chunked loss (it outran its limit), and 1b-pick-chunked (the
#   executor leaving autocast before the loss, on the 1B).
# Needs peft, accelerate, psutil and bitsandbytes beside the usual wheels, in an ignored folder carried along:
#   pip download --no-deps peft accelerate psutil bitsandbytes -d /tmp/pw (bitsandbytes: manylinux x86_64, py3.12)
#   pip install --no-deps --target .sitepeft /tmp/pw/*.whl; keep only bitsandbytes/libbitsandbytes_cuda130.so
#   echo /.sitepeft/ >> .git/info/exclude   (carry [".whl", ".whl-tf", ".sitepeft"]: 63 MiB with the tree)
#   run: python3 -m pip install ... --target /tmp/site .whl/*.whl .whl-tf/*.whl;
#        export PYTHONPATH=/tmp/site:$PWD/.sitepeft:$PWD; DEADLINE=330 bash THIS
set -u
W=/tmp/gs8; DEADLINE=${DEADLINE:-330}
source benchmarks/gpu_lib.sh
export HF_HUB_OFFLINE=1
NEW=benchmarks/data/h100-2026-11-26d/plans OLD=benchmarks/data/h100-2026-11-26/plans
ex() { step "$1" "$2" python3 -m soap execute "$3/$1.plan.json" --steps "$4" --report "$W/$1.run.json" --json; }
ex 8b4l-lora 75 $NEW 6
ex 8b4l-qlora 80 $NEW 6
ex 8b4l-eager-bf16 60 $NEW 6
ex 1b-pick-chunked 75 $OLD 8
cat "$W/steps.txt"
