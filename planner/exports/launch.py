"""Plan facts the exports share: the launch layout (nodes, processes per node) and the repeated block's class."""

from __future__ import annotations


def nodes(plan) -> int:
    return -(-plan.cluster.gpus // plan.cluster.gpus_per_node)


def procs_per_node(plan) -> int:
    return min(plan.cluster.gpus, plan.cluster.gpus_per_node)


def torchrun(plan) -> str:
    """`torchrun` with the plan's layout (multi-node flags only where there is more than one node)."""
    if nodes(plan) == 1:
        return f"torchrun --nproc_per_node {procs_per_node(plan)}"
    return (f"torchrun --nnodes {nodes(plan)} --nproc_per_node {procs_per_node(plan)} "
            "--rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500")


def layer_class(plan) -> str | None:
    """The class name of the plan's repeated transformer block (e.g. `LlamaDecoderLayer`), if it has one."""
    return next((b.module_type for b in plan.blocks if not b.id.startswith("<")), None)
