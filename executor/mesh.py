"""The plan's DeviceMesh: dimensions (pp, dp_replicate, dp_shard, cp, tp), outermost first.

Flattened views the transforms use (torchtitan's names):
    dp          = dp_replicate x dp_shard    (the batch is split over it)
    dp_shard_cp = dp_shard x cp              (FSDP shards over it: CP ranks hold different tokens)
    dp_cp       = dp_replicate x dp_shard x cp (gradients are averaged over it)
With expert parallelism (ep > 1; `executor.expert_parallel`) dp_cp is also unflattened, ep innermost,
into (edp_replicate, dp_shard_mod_ep, ep), torchtitan's layout: ep borrows ranks from dp_shard x cp:
    ep          = the ranks holding different experts (and different tokens)
    expert_dp   = (edp_replicate, dp_shard_mod_ep): the ranks holding the same experts, which sum their
                  gradients (1-D dp_shard_mod_ep when dp_replicate is 1)
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
    ep: DeviceMesh | None = None
    """The expert-parallel group (ep > 1 only)."""
    expert_dp: DeviceMesh | None = None
    """The ranks holding the same experts (ep > 1 only; see the module docstring)."""

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
    ep = expert_dp = None
    if p.ep > 1:
        experts = dp_cp._unflatten(0, (p.dp_replicate, p.dp_shard * p.cp // p.ep, p.ep),
                                   ("edp_replicate", "dp_shard_mod_ep", "ep"))
        ep = experts["ep"]
        expert_dp = experts["edp_replicate", "dp_shard_mod_ep"] if p.dp_replicate > 1 else experts["dp_shard_mod_ep"]
    return MeshView(mesh=mesh, pp=mesh["pp"], tp=mesh["tp"], cp=mesh["cp"], dp=dp,
                    dp_shard_cp=dp_shard_cp, dp_cp=dp_cp, hsdp=hsdp, ep=ep, expert_dp=expert_dp)


def device_for_rank(local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
