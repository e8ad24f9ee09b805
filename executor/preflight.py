"""Before any worker starts: can this host run the plan? (`soap execute`'s pre-flight)

`soap execute` starts `nproc` ranks on this host and each builds its part of the model, so a plan made
for another machine used to fail late and expensively (8 ranks each building Llama-3-8B on a laptop,
or 1,024 ranks spawned until memory ran out). `check_host` refuses such a launch first, in one `error:`
line that names what the plan needs, what this host has, and the fix. It reads only the plan and the
host (no model is built, no process started):

1. Device kind. A plan whose device profile is a GPU (`DeviceProfile.kind`, "gpu" unless the profile
   says "cpu") needs torch to see a CUDA (or ROCm) device. On a host without one it is refused unless
   the user asks for a CPU smoke run (`allow_cpu`, `--allow-cpu`: gloo, the model in host memory);
   the fix names `--cluster local-cpu` (re-plan for this machine) or the multi-node flags.
2. Ranks on this host. Outside torchrun, ranks here = `--nproc-per-node`, or the plan's world size over
   `--nnodes`. Launched on one node without `--nproc-per-node`, a plan whose world is larger than its
   own node (`cluster.gpus_per_node`) is refused, and the fix names the plan's node layout:
   `--nnodes W/G --nproc-per-node G` (G = gpus_per_node). On GPUs, the ranks here must not outnumber
   the visible devices (`torch.cuda.device_count()`).
3. Memory. Each rank needs the plan's predicted peak (`predicted.peak_memory_gib`, the worst rank,
   framework context included) where its tensors live:
   - on a GPU:  peak <= the device's memory (`total_memory` of device 0);
   - on CPU:    ranks here x peak <= the host's available memory (`MemAvailable`), since every rank
                 is a process of this host.

A plan without an inline device profile or without predictions (built by hand in Python) skips the
check that needs them. Under an external torchrun (one process per rank) only checks 1 and 3 apply,
with the ranks of this node taken from `LOCAL_WORLD_SIZE`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from planner.plan import Plan
from tracer.errors import SoapError

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Host:
    """What this machine offers the ranks `soap execute` starts on it."""

    gpus: int
    """CUDA (or ROCm) devices torch sees."""
    gpu_memory_bytes: int | None
    """Memory of device 0; None without a GPU."""
    available_memory_bytes: int | None
    """Host memory free for new processes (`MemAvailable`); None where it cannot be read."""

    @classmethod
    def probe(cls) -> Host:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        memory = torch.cuda.get_device_properties(0).total_memory if gpus else None
        return cls(gpus=gpus, gpu_memory_bytes=memory, available_memory_bytes=available_host_memory())


def available_host_memory() -> int | None:
    """`MemAvailable` of /proc/meminfo in bytes (free plus reclaimable cache), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def plan_device_kind(plan: Plan) -> str | None:
    """"gpu" or "cpu" from the plan's inline device profile; None when the plan carries none."""
    device = plan.cluster.profile.get("device")
    return device.get("kind", "gpu") if isinstance(device, dict) else None


def node_layout(plan: Plan) -> tuple[int, int]:
    """(nodes, ranks per node) of the plan's cluster: the launch flags that run it as planned."""
    per_node = min(plan.world_size, plan.cluster.gpus_per_node)
    return -(-plan.world_size // per_node), per_node


def check_world_size(plan: Plan, launched: int) -> None:
    """Refuse a launch of another world size than the plan's, naming the plan's node layout."""
    if launched != plan.world_size:
        nodes, per_node = node_layout(plan)
        raise SoapError(
            f"the plan needs {plan.world_size} ranks, launched {launched}; fix: launch its {nodes} node(s) of "
            f"{per_node} with --nnodes {nodes} --nproc-per-node {per_node}, or re-plan with --gpus {launched}"
        )


def check_host(plan: Plan, *, nproc_per_node: int | None, nnodes: int, allow_cpu: bool,
               under_torchrun: bool = False, host: Host | None = None) -> None:
    """Refuse a launch this host cannot run (the module docstring's three checks); returns on success."""
    host = host or Host.probe()
    kind = plan_device_kind(plan)
    nodes, per_node = node_layout(plan)
    multi_node = f"--nnodes {nodes} --nproc-per-node {per_node} --node-rank R --rdzv-endpoint HOST:PORT"
    on_gpu = host.gpus > 0
    if kind == "gpu" and not on_gpu and not allow_cpu:
        raise SoapError(
            f"the plan is for {plan.world_size} {plan.cluster.name} GPU(s) and this host has no GPU torch can see; "
            f"fix: re-plan for this machine (soap plan ... --cluster local-cpu), run on the GPU nodes "
            f"({multi_node} on each), or pass --allow-cpu for a slow CPU smoke run")
    if under_torchrun:
        here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    else:
        if nproc_per_node is None and nnodes == 1 and plan.world_size > plan.cluster.gpus_per_node:
            raise SoapError(
                f"the plan needs {plan.world_size} ranks on {nodes} nodes of {per_node} and this launch is one node; "
                f"fix: run `soap execute ... {multi_node}` on each node, or pass --nproc-per-node "
                f"{plan.world_size} to start all ranks on this host")
        here = nproc_per_node or max(1, plan.world_size // nnodes)
        if on_gpu and here > host.gpus:
            raise SoapError(
                f"{here} ranks on this node but torch sees {host.gpus} GPU(s); fix: {multi_node} across the plan's "
                f"nodes, or re-plan with --gpus {host.gpus}")
    _check_memory(plan, here=here, on_gpu=on_gpu, host=host)


def _check_memory(plan: Plan, *, here: int, on_gpu: bool, host: Host) -> None:
    peak = plan.predicted.get("peak_memory_gib")
    if not isinstance(peak, (int, float)) or peak <= 0:
        return
    need = peak * GIB
    if on_gpu and host.gpu_memory_bytes is not None and need > host.gpu_memory_bytes:
        raise SoapError(
            f"the plan needs {peak:.1f} GiB per GPU and this host's GPUs have {host.gpu_memory_bytes / GIB:.1f} GiB; "
            f"fix: re-plan for this GPU (soap plan ... --mem-limit {host.gpu_memory_bytes / GIB:.0f}) or run on "
            f"the plan's {plan.cluster.name} nodes")
    if not on_gpu and host.available_memory_bytes is not None and here * need > host.available_memory_bytes:
        raise SoapError(
            f"{here} rank(s) of {peak:.1f} GiB each need {here * peak:.1f} GiB of host memory and this host has "
            f"{host.available_memory_bytes / GIB:.1f} GiB available; fix: re-plan a smaller model or fewer ranks for "
            f"this machine (soap plan ... --cluster local-cpu), or run on the plan's nodes")
