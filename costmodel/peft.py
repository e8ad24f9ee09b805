"""PEFT in the cost model: what LoRA and QLoRA change, and QLoRA's 4-bit base weights.

LoRA needs no term of its own. The graph is traced with the adapters injected (tracer/peft.py), so:
- frozen base weights are `frozen` parameters (`costmodel.memory.stage_params`): weights only, at
  `costmodel.memory.FROZEN_WEIGHT_BYTES` (the executor holds them in the run's compute dtype,
  `executor.peft`: 4 bytes in fp32, 2 in bf16/fp16, so autocast makes no copy of them), no gradient
  and no optimizer state;
- the adapters are trainable parameters (r x (in + out) per target) with gradients and optimizer state,
  like any other (`model_state_bytes`'s table);
- a frozen linear's backward computes its input gradient only (its backward FLOPs equal its forward's,
  `costmodel.opcost.backward_kernels` runs one kernel), and autograd saves no input for a weight
  gradient; the adapters' matmuls add their FLOPs and saved tensors (the tracer's autograd rules,
  checked against live storages in tests/test_peft_memory.py).

QLoRA (bitsandbytes `Params4bit`, quant_type nf4, blocksize 64, double quantization, as
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)`)
keeps each target's base weight of n elements in `nf4_bytes(n)` bytes:

    packed 4-bit codes                   ceil(n / 2)                                uint8
    absmax per 64-element block          ceil(n / 64)                               uint8 (double quantization)
    absmax of the absmax, per 256        4 * ceil(ceil(n / 64) / 256)               fp32
    code tables and offset               NF4_TENSOR_CONSTANT_BYTES                  16 + 256 fp32 levels, 1 fp32
so about 0.516 bytes (4.13 bits) per element on a large weight. They are device weights (`quantized`
in `model_state_bytes`), never sharded: QLoRA runs data parallelism on DDP only (`plan_rules`).
Transients (`dequantize_buffer_bytes`): each 4-bit matmul dequantizes its weight to the compute dtype
in forward and again in backward for the input gradient, and frees it after; one such copy is live at a
time, the largest target weight at the compute width (the `buffers` term). That is why QLoRA can hold
more than LoRA on a small model: the constants and the dequantized copy outweigh the saving when the
weights are small, and the activations (the bulk at long sequences) are the same.
Time (`dequantize_time`): a memory-bound kernel that reads the packed weight and writes the
compute-dtype copy, once in forward and once more in backward (counted on whichever op reads the weight
first: a traced autocast cast or the matmul itself; every block but the first needs the input gradient).
It moves those bytes at `NF4_DEQUANTIZE_RATE` of a plain copy's streaming rate (the device's memory bandwidth
times its efficiency at that size):

    t = (nf4_bytes(n) + n x compute itemsize) / (bandwidth x memory_efficiency(bytes) x NF4_DEQUANTIZE_RATE)
        + kernel_overhead
"""

from __future__ import annotations

import math

from costmodel.profiles import DeviceProfile
from tracer.ir import OpNode
from tracer.peft import QLORA_BASE_DTYPE

NF4_BLOCK = 64
"""Elements per quantization block (bitsandbytes' default blocksize for 4-bit)."""
NESTED_BLOCK = 256
"""Blocks per second-level block of the double quantization."""
NF4_TENSOR_CONSTANT_BYTES = 16 * 4 + 256 * 4 + 4
"""Per tensor: the 16 NF4 levels and the 256 levels of the nested 8-bit code, in fp32, and the offset."""


NF4_DEQUANTIZE_RATE = 0.52
"""bitsandbytes' `dequantize_4bit` (nf4, double quantization) against a copy of the same bytes. Measured on a lent
H200, 2026-11-27 (`benchmarks/qlora_dequant.py`, `benchmarks/data/h100-2026-11-27-kernels/dequant-h200*.json`): the
GPU's own time of its three kernels (torch.profiler) for Llama-3-8B's seven projections sums to 284 us a layer,
priced 136 us of copies on `dgx-h200` plus one kernel overhead each: 0.52 (0.54 on `h200-x1-measured`). A weight of
10-150 MB moves at 1.2-2.1 TB/s. In a step it costs that twice: a forward and backward through the 4-bit weight
took 2.0x the kernel's time beyond the same through a bf16 weight. On H100 the steps of 2026-11-27 read 1.2-1.6 TB/s
for it (QLoRA over LoRA, `benchmarks/peft_h100.py`); at 1.0 (the copy's rate) it was priced at half that cost."""


def nf4_bytes(numel: int) -> int:
    """Bytes of one NF4 weight of `numel` elements with its double-quantized statistics (module docstring)."""
    blocks = math.ceil(numel / NF4_BLOCK)
    return math.ceil(numel / 2) + blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + NF4_TENSOR_CONSTANT_BYTES


def is_quantized(dtype: str) -> bool:
    return dtype == QLORA_BASE_DTYPE


def dequantize_buffer_bytes(largest_quantized: int, precision: str) -> int:
    """The dequantized copy of the largest 4-bit weight, at the compute width of `precision`."""
    from costmodel.opcost import activation_itemsize  # opcost prices `dequantize_time` with this module

    return largest_quantized * activation_itemsize(precision)


def dequantize_time(op: OpNode, *, device: DeviceProfile, precision: str) -> tuple[float, float]:
    """(forward, backward) seconds `op` spends dequantizing its 4-bit weights (0, 0 without any)."""
    numel = sum(p.numel for p in op.params if is_quantized(p.dtype))
    if not numel:
        return 0.0, 0.0
    once = dequantize_seconds(numel, device=device, precision=precision)
    return once, once


def dequantize_seconds(numel: int, *, device: DeviceProfile, precision: str) -> float:
    """One dequantization of `numel` 4-bit elements to the compute width of `precision` (module docstring)."""
    from costmodel.opcost import activation_itemsize

    nbytes = nf4_bytes(numel) + numel * activation_itemsize(precision)
    rate = device.memory_bandwidth * device.memory_efficiency.at(nbytes) * NF4_DEQUANTIZE_RATE
    return nbytes / rate + device.kernel_overhead_s
