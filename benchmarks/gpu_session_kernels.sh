#!/usr/bin/env bash
# One lent GPU call (H100 or H200), prepared and run 2026-11-27 on a lent H100 (`benchmarks/gpu_kernels_docs.py`
# renders what it wrote): the two kernel measurements issue 27's notes left for a lent GPU, and the GPU-marked tests.
# - `benchmarks/sdpa_backends.py`: torch's SDPA kernels (FlashAttention-2, memory-efficient, cuDNN, math) timed
#   against each other at Llama-3-8B's head shape, seq 2k-32k, forward and backward. The fit over torchtitan's
#   runs and soap's own (own_runs_corpus, variant (c)) read FlashAttention-2 at x2.26 cuDNN's time on 500 W
#   parts; measured 1.76x, now the fit's prior for that term (`executor.validation.external.MEASURED_PRIORS`).
# - `benchmarks/qlora_dequant.py`: bitsandbytes' dequantize_4bit of each Llama-3-8B weight against its price
#   (QLoRA's step measured ~2x the priced dequantization on 2026-11-27); its host-bound timer led to the GPU
#   kernel times of the next call (H200), now `costmodel.peft.NF4_DEQUANTIZE_RATE`.
# Needs nothing carried for the first; the second needs bitsandbytes (.sitepeft, as gpu_session_peft.sh) and
# pydantic (.whl) for soap's profiles:
#   run: python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl &&
#        export PYTHONPATH=/tmp/site:$PWD/.sitepeft:$PWD; DEADLINE=300 bash THIS
set -u
W=/tmp/gs-kernels; DEADLINE=${DEADLINE:-300}
source benchmarks/gpu_lib.sh
step sdpa 150 python3 -m benchmarks.sdpa_backends --out "$W/sdpa.json"
cat "$W/sdpa.out"
step dequant 90 python3 -m benchmarks.qlora_dequant --out "$W/dequant.json"
cat "$W/dequant.out"
step pytest-gpu 70 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header tests/test_autocast_gpu.py tests/test_validation.py \
  tests/test_calibration.py tests/test_step_factor.py tests/test_peft_execute.py
tail -5 "$W/pytest-gpu.out"
cat "$W/steps.txt"
