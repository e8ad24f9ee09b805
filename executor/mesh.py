"""The plan's DeviceMesh: dimensions (pp, dp_replicate, dp_shard, cp, tp), outermost first.

Flattened views the transforms use (torchtitan's names):
    dp          = dp_replicate x dp_shard    (the batch is split over it)
    dp_shard_cp = dp_shard x cp              (FSDP shards over it: CP ranks hold different tokens)
    dp_cp       = dp_replicate x dp_shard x cp (gradients are averaged over it)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from costmodel.strategy import MESH_DIM_NAMES
from planner.plan import Plan


@dataclass(frozen=True)
class MeshView:
    """The plan's mesh and the sub-meshes each transform needs."""

    mesh: DeviceMesh
    pp: DeviceMesh
    tp: DeviceMesh
    cp: DeviceMesh
    dp: DeviceMesh
    dp_shard_cp: DeviceMesh
    dp_cp: DeviceMesh
    hsdp: DeviceMesh
    """(dp_replicate, dp_shard_cp) when both are > 1 (HSDP), else dp_shard_cp."""

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()

    @property
    def cp_rank(self) -> int:
        return self.cp.get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.pp.get_local_rank()


def build_mesh(plan: Plan, device_type: str) -> MeshView:
    """Build the mesh over the initialized default process group."""
    p = plan.parallelism
    mesh = init_device_mesh(device_type, plan.mesh.degrees, mesh_dim_names=MESH_DIM_NAMES)
    dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    dp_shard_cp = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    dp_cp = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    hsdp = mesh["dp_replicate", "dp_shard_cp"] if p.dp_replicate > 1 and p.dp_shard * p.cp > 1 else dp_shard_cp
    return MeshView(mesh=mesh, pp=mesh["pp"], tp=mesh["tp"], cp=mesh["cp"], dp=dp,
                    dp_shard_cp=dp_shard_cp, dp_cp=dp_cp, hsdp=hsdp)


def device_for_rank(local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
