"""ZeRO-3 parameter gathers at scale: how a stack all-gathers its sharded parameters, and what that costs.

A ZeRO-3/FSDP rank holds 1/n of every parameter (n = dp_shard ranks) and all-gathers a parameter before an
op reads it. Two stacks gather at different granularities (`TrainingConfig.param_gather`):

- `block` (FSDP2, soap's executor, `executor.data_parallel`): one all-gather of a unit's (block instance's)
  parameters, flattened into one buffer, before its forward and one before its backward
  (reshard_after_forward); a full recompute runs under the backward's gather (FSDP2's forward pre-hook does
  not gather in the pre-backward state), so 2 gathers per unit and micro-batch. The gather of the next unit
  is issued before this one computes (prefetch one unit ahead, `costmodel.simulator.step`), so gathers cost
  nothing while a micro-batch's dp traffic fits under its compute. Priced in `costmodel.simulator.pricing`
  (`_UnitPricer._gather`, `param_gather_s` on the dp-comm stream) at `memory.fsdp_param_bytes` per element.
- `tensor` (DeepSpeed ZeRO-3 as of 2021, `deepspeed.runtime.zero.partition_parameters._allgather_param`, the
  stack of the SC'21 comparison below): one all-gather per parameter tensor, each into a list of n views of
  a fresh flat buffer, after `torch.cuda.synchronize()`; the module's fp16 parameters are gathered (2 bytes
  at fp16/bf16, 4 at fp32: `gather_width`). Under full recompute (Megatron's reentrant checkpointing) the
  recomputed forward runs the module hooks again, so 3 gathers per tensor and micro-batch (forward,
  recompute, backward: `gathers_per_microbatch`). Priced by `tensor_gathers_time` on the chunk's critical path
  (`ChunkCost.fwd_comm_s` and `bwd_comm_s`).

Per gather of a tensor of e elements at width w over a ring of n ranks, g per node, N = n / g nodes:

    t = (n-1)/n x e w / (bw x eff)            bandwidth: bw = min(NVLink, g x NIC) (`collectives.flat_path`)
      + (n - N) x a_intra + (N - 1) x a_inter  the ring's latency steps (`collectives.ring_latency`)
      + c                                      the collective's host call (device `collective_call_overhead_us`)
      + n x k                                  `tensor` only: torch's NCCL all_gather into a list of n outputs
                                               gathers into one flat buffer and copies it out to each output,
                                               n copy kernels (device `kernel_overhead_us` each)

The first term does not depend on the granularity: per micro-batch a rank moves every parameter's
gathered bytes G times (G = gathers per micro-batch), P x w x G, through its node's g NICs. The others are
per call: `block` makes G x units calls, `tensor` G x tensors calls (12 per GPT layer: two layer norms
and four linear layers, weight and bias each), and both the latency steps and the list copies grow with n.

How much prefetch hides: under `block`, prefetch one unit ahead overlaps the whole gather with the
previous unit's compute (the dp stream carries gathers and reduce-scatters while the chunk computes), so
a micro-batch takes max(compute, sum of its dp traffic). Under `tensor`, none: the synchronize before each
tensor's gather waits for the compute issued before it and the next op waits for its gather (a
prefetched gather of the next module overlaps at most the one op launched after the last synchronize),
so gathers add to compute: compute + sum of its gathers. The gradient reduce-scatter is priced as FSDP2's
for both (one per unit, fp32, on the dp stream, overlapping compute; DeepSpeed buckets fp16 gradients, so
this is the larger of the two and still hidden here).

Worked example, the SC'21 comparison (Narayanan et al., "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", SC'21, Table 4 and Figure 10): a 175B GPT (96 layers, hidden 12288, seq
2048, global batch 1,536, fp16, full recompute) on 384 / 768 / 1,536 A100 80GB (`dgx-a100-80g`: 8 per node,
8 x 200 Gb/s InfiniBand, g = 8, NIC 25 GB/s per GPU at 0.86 efficiency for large messages, N = 48 / 96 /
192 nodes). Published TFLOP/s per GPU (the paper's formula 96 B s l h^2 (1 + s/6h + V/16lh), recompute
included: 4.51e18 FLOPs per step): DeepSpeed ZeRO-3 without model parallelism, micro-batch 4 / 2 / 1 (one
micro-batch per GPU per step), 144 / 88 / 44, a step of 82 / 67 / 67 s; PTD-P (tp 8 x pp 12, micro-batch 1)
153 / 149 / 141. A block holds p = 1.81e9 parameters in 12 tensors (the largest 12288 x 49152). Per
micro-batch, at 384 / 768 / 1,536 ranks:

    block (FSDP2; fp16 gathers fp32)      tensor (DeepSpeed 2021; fp16 model)
    96 x (2 gathers + 1 reduce-scatter)   96 x 12 x 3 = 3,456 gathers (+ 96 reduce-scatters, as FSDP2's)
    bytes 175e9 x (2 x 4 + 4) / 172 GB/s  bytes 175e9 x 3 x 2 / 172 GB/s = 6.1 s
      = 12.2 s
    latency per call 0.83 / 1.66 / 3.32 ms (ring, the same for both: 383 / 767 / 1,535 steps, 47 / 95 /
      191 of them between nodes at 4 us, the rest at 1.9 us)
    no copies                              copies per call n x 7 us = 2.7 / 5.4 / 10.8 ms
    per micro-batch 12.3 / 12.6 / 13.1 s   per micro-batch 18.2 / 30.4 / 54.7 s (rings 31 / 41 / 61 ms
      on the dp stream, under about 14.7 s   and copies 32 / 65 / 129 ms per block and gather), blocking:
      of compute: hidden                    added to about 12 s of compute (the half model's)

So soap's executor stays compute-bound at every size (simulated 231 / 223 / 199 TFLOP/s by the paper's
formula; too fast for a datasheet A100, as the 3-D plan's are), while the per-tensor stack's gathers grow
with n, both the ring's latency steps and the list copies: simulated 181 / 109 / 44 TFLOP/s (published
144 / 88 / 44), where Megatron's tp8 x pp12 holds 195 / 187 / 174 (153 / 149 / 141). Priced as DeepSpeed
ran it, ZeRO-3 ranks below the 3-D plan at 768 and 1,536 GPUs by 1.7x and 4x (published 1.7x and 3.2x),
and at 384 7% below it (published 6%), a margin inside the model's error (`benchmarks/sc21_zero3.py` prints the
table, docs/benchmarks.md records it, tests/test_zero3_gathers.py holds the ranking at 768 and 1,536).
No number here is fitted: the latencies are NCCL's tuner values (`collectives.ring_latency`), the copy the
device profile's per-kernel floor, the bandwidth its nccl-tests efficiency. The copy is the least certain
term (a small copy's launch from C++, 3-10 us): at 3 us ZeRO-3 gives 197 / 136 / 65 TFLOP/s, at 10 us
170 / 95 / 36; below the 3-D plan at 768 and 1,536 GPUs across that range, level with it at 384.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from costmodel.collectives import CommGroup
from costmodel.memory import fsdp_param_bytes
from costmodel.opcost import activation_itemsize


def gathers_per_microbatch(*, zero: int, sharded: bool, granularity: str, recompute: str) -> int:
    """All-gathers of each parameter per micro-batch (module docstring): zero 3 gathers before forward and
    backward, and, per tensor under full recompute, again for the recomputed forward; zero 2 once."""
    if not sharded or zero < 2:
        return 0
    if zero == 2:
        return 1
    return 3 if granularity == "tensor" and recompute == "full" else 2


def gather_width(precision: str, granularity: str) -> int:
    """Bytes per gathered element: FSDP2's (`memory.fsdp_param_bytes`: fp32 at fp16) for `block`; the
    module's own 16-bit parameters for `tensor` (DeepSpeed keeps fp16/bf16 parameters, fp32 masters apart)."""
    return fsdp_param_bytes(precision) if granularity == "block" else activation_itemsize(precision)


def tensor_gathers_time(tensor_elements: Sequence[int], width: int, group: CommGroup, *,
                        collective: Callable[[str, float, CommGroup], float], kernel_s: float) -> float:
    """One `tensor`-granularity gather of a unit: an all-gather per tensor (`collective`, the pricer's, which
    adds the host call) plus its n list-output copies at `kernel_s` each (module docstring)."""
    if group.size <= 1:
        return 0.0
    return sum(collective("all_gather", e * width, group) + group.size * kernel_s for e in tensor_elements if e)
