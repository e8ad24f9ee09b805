"""Room for the caching allocator: how much of a GPU's memory a plan may be planned to fill.

PyTorch's CUDA caching allocator hands tensors out of segments it reserves from the driver. What a run
needs from the device is the allocator's *reserved* peak, not the peak of live tensors:

    reserved = allocated + T + r x allocated                                           (1)

T is the loss's largest fp32 transient, made and freed before the peak, whose segment the allocator keeps
and does not reuse for the peak's tensors (`costmodel.memory_activations.loss_transient`: the fp32 logits of a
micro-batch under the upcast loss, one fp32 slice under the chunked one), on the rank that holds the loss. On
the 19 runs of soap's executor on a lent H100 and H200 that logged both peaks, reserved - allocated is 0.8-1.15
T for the Llama shapes, eager or compiled, upcast or chunked (0.4-1.4 T for GPT-2), and T alone predicts the
reserved peak within 2.1% on average (a fraction of allocated fitted to the same runs: 4.6%;
`benchmarks/allocator_reserve.py`): the upcast loss's 8-17% over allocated and the chunked loss's 1-6% are one
rule. r, the device's `allocator_reserve_fraction`, is the rest: the median of (reserved - allocated - T) /
allocated over runs that report both (`soap calibrate --from-runs`), about 0 on those runs.
`costmodel.memory.reserve_bytes` adds T + r x allocated to the predicted peak of a profile with a fitted r,
which then predicts reserved memory.

Near the device's capacity the allocator no longer finds a free block of the size asked for: it frees its
cached segments and calls cudaMalloc again (a device-wide synchronization, `num_alloc_retries` in
`torch.cuda.memory_stats`), and fragmentation makes the reserved peak grow further. A run there either
slows down or dies, and which it does depends on the allocation order, not on anything the memory model
sees. On a measured grid of one node of 8 H100 (issue 27), the configuration predicted fastest sat at
95-97% of device memory and ran at 37% of the best configuration's speed; configurations below about 85%
ran near where their prediction ranked them.

So the search plans to a limit below the capacity M:

    limit = M x (1 - margin),      margin = DEFAULT_MARGIN on a GPU, 0 on a CPU profile       (2)

(a CPU process has no caching allocator; the host's memory is what `--mem-limit` is for). The margin is
printed with the plan and written to its `--json`; `--mem-limit GIB` replaces (2) by the user's number,
margin 0. What counts against the limit is the predicted peak of (1): allocated memory when the profile
has no fitted r, reserved memory when it has one.

DEFAULT_MARGIN = 0.10: the 85% at which the measured grid stopped ranking well is a reserved-or-allocated
figure of unknown kind; a 10% margin on top of a predicted *allocated* peak leaves the reserve of (1)
inside the limit under the executor's chunked loss (1-6% of the allocated peak, measured), though not always
under the upcast one (8-17%: up to the fp32 logits of a micro-batch). It is a rule of the search, not a fitted number:
a configuration over it is not impossible (the Playbook's grid ran some), only not worth choosing.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.profiles import DeviceProfile
from tracer.errors import SoapError

GIB = 2**30

DEFAULT_MARGIN = 0.10
"""Share of a GPU's memory the search leaves free for the caching allocator (module docstring, (2))."""


@dataclass(frozen=True)
class MemoryLimit:
    """What the search may fill per rank, and why."""

    bytes: float
    margin: float
    """The share of the device kept free (0 when `--mem-limit` set the limit or the device is a CPU)."""
    device_bytes: float
    given: bool
    """True when the user gave the limit (`--mem-limit`)."""

    def describe(self) -> str:
        """One line for the plan's output."""
        if self.given:
            return f"limit {self.bytes / GIB:.1f} GiB from --mem-limit"
        if self.margin == 0:
            return f"limit {self.bytes / GIB:.1f} GiB, the device's memory"
        return (f"limit {self.bytes / GIB:.1f} GiB: the device's {self.device_bytes / GIB:.1f} GiB less "
                f"{self.margin:.0%} kept for the caching allocator (--mem-limit overrides)")


def planning_limit(device: DeviceProfile, mem_limit_gib: float | None = None,
                   margin: float | None = None) -> MemoryLimit:
    """The per-rank memory the search plans to: `mem_limit_gib` when given, else (2) of the docstring."""
    capacity = float(device.memory_bytes)
    if mem_limit_gib is not None:
        if not mem_limit_gib > 0:
            raise SoapError(f"--mem-limit={mem_limit_gib!r} must be a positive number of GiB")
        return MemoryLimit(bytes=mem_limit_gib * GIB, margin=0.0, device_bytes=capacity, given=True)
    if margin is None:
        margin = DEFAULT_MARGIN if device.kind == "gpu" else 0.0
    if not 0 <= margin < 1:
        raise SoapError(f"memory margin {margin!r} must be in [0, 1)")
    return MemoryLimit(bytes=capacity * (1 - margin), margin=margin, device_bytes=capacity, given=False)
