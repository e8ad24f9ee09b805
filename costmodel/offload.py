"""The host's share of a training step whose optimizer is offloaded (FSDP2's CPUOffloadPolicy, as
`executor.data_parallel` runs it): what one rank moves and computes outside the GPU's kernels, per optimizer step.

For `e` elements of fp32 parameter shards on a rank (its stage's parameters / dp_shard), with

    s = gradient syncs a step: num_microbatches without a pipeline (the training loop has no no_sync for FSDP2:
        every backward reduce-scatters), grad_accum with one (torch's stage defers the sync and the reshard to
        each schedule run's last backward)
    g = all-gathers a step: 2 x num_microbatches with zero 3 (reshard after forward), else s

the step pays, serially with the GPU's kernels (an upper bound: FSDP2 issues its copies on its all-gather and
reduce-scatter streams):

    up          4 e g / L          each all-gather copies the fp32 shards up (pinned, non-blocking)
    down        4 e / L            the first sync copies its fp32 gradient down (pinned, non-blocking)
    accumulate  4 e (s - 1) / A    every later sync: FSDP2 copies the gradient down blocking, into pageable memory,
                                   and adds it to the host's on the CPU, parameter by parameter
                                   (torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_reduce)
    step        r_o 28 e / H       the optimizer o on the host: r_o times torch's fused AdamW, one pass over 28
                                   bytes an element (parameter, gradient and two moments read, parameter and
                                   moments written); an optimizer without a measured r_o is one pass over
                                   b = 2 x 4 + 4 + 2 x state bytes an element, b e / H

L is the device's host link (`DeviceProfile.host_bandwidth`); A and H are the host's, measured on one GPU
machine's host (below) and used for every GPU profile, whose hosts no profile describes. On a CPU device
(`kind` "cpu") the "host" is the device: every term is at its host rate L, as before this module.

Measured on a lent H200 with a 16-core host, 2026-11-28 (benchmarks/offload_h200.py,
benchmarks/data/h200-2026-11-28/): Llama 3.2 1B (1.24e9 parameters), 4 x 2,048 tokens a micro-batch, offload, ran
0.58 s a step with 1 micro-batch, 4.44 s with 2 and 11.2 s with 4: each micro-batch after the first cost about
3.4 s, against 0.18 s of compute. HOST_ACCUMULATE is fitted to the 4-micro-batch run (1 and 2 held out);
HOST_STEP is the host's torch fused AdamW timed alone over the same elements (benchmarks/host_adamw.py: 0.30 s,
where the foreach AdamW took 1.23 s; the executor steps the fused one on the host).

The other optimizers run as the executor runs them on the host, foreach (DTensor, FSDP2's parameters, has no rule for
torch's fused SGD; Adafactor has no fused kernel): r_o (`HOST_OPTIMIZER_RATIO`) is their time an element over the
fused AdamW's, timed on the 2-core CPU machine (benchmarks/data/local-cpu-2026-11-28/host-optimizers.json, 1e8 fp32
elements): SGD with momentum 1.20, Adafactor 5.40 (its row and column statistics are several passes of small
kernels). The lent H200's host ran only AdamW; a ratio carries from one host to the other: the same run's foreach
AdamW is 4.17x its fused one, the H200 host's 4.09x; its gradient add 0.43x, the H200 host's 0.45x.
"""

from __future__ import annotations

from typing import Any

from costmodel.memory import FSDP_GRAD_BYTES, FSDP_MASTER_BYTES
from costmodel.optimizer_step import optimizer_step_bytes

HOST_STEP_BYTES_PER_S = 115.3e9
"""The host's optimizer pass (bytes it reads and writes a second): torch's fused AdamW over 1.24e9 fp32 elements
on a lent H200's 16-core host, 0.3015 s at 28 bytes an element (benchmarks/host_adamw.py, 2026-11-28)."""
HOST_OPTIMIZER_RATIO = {"adamw": 1.0, "sgd": 1.20, "adafactor": 5.40}
"""The executor's host optimizer's time an element over torch's fused AdamW's (module docstring: r_o), timed on the
CPU machine over 1e8 fp32 elements (benchmarks/host_adamw.py): fused AdamW 105.7 ms, foreach SGD (momentum 0.9)
126.8 ms, foreach Adafactor 571.2 ms."""
HOST_ACCUMULATE_BYTES_PER_S = 1.51e9
"""fp32 gradient bytes a second that FSDP2's offloaded accumulation takes in (blocking copy into pageable memory
and the CPU's add), fitted to Llama 3.2 1B's 4-micro-batch offload run on a lent H200 (11.19 s a step; the 1- and
2-micro-batch runs held out: benchmarks/offload_h200.py)."""


def offload_syncs(*, pp: int, train: Any) -> tuple[int, int]:
    """(gradient syncs, all-gathers) one rank's parameter shards see in a step (the module's s and g)."""
    syncs = train.num_microbatches if pp == 1 else train.grad_accum
    gathers = 2 * train.num_microbatches if train.zero == 3 else syncs
    return syncs, gathers


def offload_time(elems: float, *, pp: int, train: Any, device: Any) -> float:
    """Seconds of one rank's step outside its GPU kernels under offload (the module's up + down + accumulate +
    step) for `elems` elements of parameter shards on `device`."""
    syncs, gathers = offload_syncs(pp=pp, train=train)
    # the host's fp32 shards: a measured optimizer at its ratio to the fused AdamW's pass (the bytes
    # HOST_STEP_BYTES_PER_S was measured in), another as one pass over its own bytes
    ratio = HOST_OPTIMIZER_RATIO.get(train.optimizer)
    step = (ratio * optimizer_step_bytes(elems, precision="fp32", optimizer="adamw") if ratio is not None
            else optimizer_step_bytes(elems, precision="fp32", optimizer=train.optimizer))
    link = elems * FSDP_MASTER_BYTES * gathers + elems * FSDP_GRAD_BYTES
    accumulate = elems * FSDP_GRAD_BYTES * (syncs - 1)
    if device.kind == "cpu":
        return (link + 4 * accumulate + step) / device.host_bandwidth  # 4 e (s - 1) down, 12 to add
    return link / device.host_bandwidth + accumulate / HOST_ACCUMULATE_BYTES_PER_S + step / HOST_STEP_BYTES_PER_S
