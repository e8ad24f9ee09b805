"""Starting the ranks: torch's elastic launcher (what torchrun runs), or in-process under torchrun.

`run_plan(plan, run, launch)`:
- under an external torchrun (RANK, WORLD_SIZE and LOCAL_RANK set) this process is one rank: it joins
  the process group from the environment and trains;
- otherwise it launches `nnodes x nproc_per_node` workers with `elastic_launch(LaunchConfig(...))`, with
  torchrun's semantics: one node and no rendezvous endpoint is `--standalone` (a c10d store on a free
  local port); otherwise the given rendezvous backend (torchrun's default `static`, at
  `--rdzv-endpoint` or `--master-addr:--master-port`, with this node's `--node-rank`).
The backend is NCCL when CUDA is present, else gloo. Rank 0's `RunResult` comes back as a dict.
Each worker joins the process group through the agent's store under a per-attempt key prefix
(`attempt_store`), so a group restarted after a failure (`--max-restarts`) never reads its killed
predecessor's rendezvous keys.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any

from planner.plan import Plan, plan_from_dict
from tracer.errors import SoapError

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """torchrun's launch flags."""

    nproc_per_node: int | None = None
    """Workers on this node; default: the plan's world size divided by the node count."""
    nnodes: str = "1"
    """Node count, `N` or `MIN:MAX` (elastic)."""
    node_rank: int = 0
    """This node's rank (static rendezvous)."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the rendezvous; default `master_addr:master_port`."""
    rdzv_backend: str = "static"
    """`static` or `c10d` (or any backend torch's elastic agent knows)."""
    rdzv_id: str | None = None
    """Job id shared by all nodes; default a random one on a single node."""
    max_restarts: int = 0
    """Restarts of the worker group after a failure."""
    master_addr: str = "127.0.0.1"
    master_port: int = 29500


def under_torchrun() -> bool:
    return all(key in os.environ for key in TORCHRUN_ENV)


def node_counts(nnodes: str) -> tuple[int, int]:
    try:
        low, _, high = nnodes.partition(":")
        result = int(low), int(high or low)
    except ValueError:
        raise SoapError(f"--nnodes {nnodes!r}: expected N or MIN:MAX") from None
    if result[0] < 1 or result[1] < result[0]:
        raise SoapError(f"--nnodes {nnodes!r}: need 1 <= MIN <= MAX")
    return result


def run_plan(plan: Plan, run: Any, launch: LaunchOptions) -> dict[str, Any] | None:
    """Train `plan` on all ranks; returns rank 0's result dict (None on other ranks and nodes)."""
    from executor.api import check_world_size

    if under_torchrun():
        check_world_size(plan, int(os.environ["WORLD_SIZE"]))
        return _worker(plan.to_json(), run)
    min_nodes, max_nodes = node_counts(launch.nnodes)
    if min_nodes != max_nodes and plan.world_size % min_nodes:
        raise SoapError(f"elastic --nnodes {launch.nnodes}: the plan's {plan.world_size} ranks are fixed; "
                        "pass a fixed node count")
    if launch.nproc_per_node is not None and launch.nproc_per_node < 1:
        raise SoapError(f"--nproc-per-node {launch.nproc_per_node}: need at least 1 worker per node")
    nproc = launch.nproc_per_node or max(1, plan.world_size // max_nodes)
    check_world_size(plan, nproc * max_nodes)
    return _elastic(plan, run, launch, nproc, min_nodes, max_nodes)


def _elastic(plan: Plan, run: Any, launch: LaunchOptions, nproc: int, min_nodes: int,
             max_nodes: int) -> dict[str, Any] | None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    standalone = max_nodes == 1 and launch.rdzv_endpoint is None
    backend = "c10d" if standalone else launch.rdzv_backend
    endpoint = "localhost:0" if standalone else (launch.rdzv_endpoint or f"{launch.master_addr}:{launch.master_port}")
    configs: dict[str, Any] = {"rank": launch.node_rank} if backend == "static" else {}
    config = LaunchConfig(
        min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc,
        run_id=launch.rdzv_id or (uuid.uuid4().hex if standalone else "none"),
        rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_configs=configs,
        max_restarts=launch.max_restarts, monitor_interval=0.1, start_method="spawn",
    )
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        results = elastic_launch(config, _worker)(plan.to_json(), run)
    except ChildFailedError as exc:
        rank, first = next(iter(exc.failures.items()))  # keyed by global rank
        raise SoapError(f"a worker failed (rank {rank}, exit code {first.exitcode}); its error is above. "
                        "Fix it and rerun, or add --debug") from None
    result = results.get(0)
    if isinstance(result, dict) and "error" in result:
        raise SoapError(result["error"])
    return result


def _worker(plan_json: str, run: Any) -> dict[str, Any] | None:
    """One rank: join the process group from torchrun's environment, train, report from rank 0."""
    import json

    import torch
    import torch.distributed as dist

    from executor.train import train

    plan = plan_from_dict(json.loads(plan_json))
    backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
    store, rank, world_size = next(dist.rendezvous("env://"))
    dist.init_process_group(backend, store=attempt_store(store), rank=rank, world_size=world_size)
    try:
        result = train(plan, run, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        return result.to_json() if dist.get_rank() == 0 else None
    except SoapError as exc:
        return {"error": str(exc)}
    finally:
        dist.destroy_process_group()


def attempt_store(store: Any) -> Any:
    """`store` with a key prefix naming this attempt of the worker group.

    The elastic agent keeps one TCPStore for the whole job and torch's env:// rendezvous joins it
    without a prefix, so a restarted group would read the keys its killed predecessor left there:
    gloo's peer addresses (`default_pg/0//cpu//0/RANK`: a rank connects to the dead rank's port and
    fails with `Connection refused`, unless the new peer happened to overwrite the key first) and the
    init barrier's counters. Each attempt (`TORCHELASTIC_RESTART_COUNT`) gets its own key space."""
    import torch.distributed as dist

    return dist.PrefixStore(f"soap/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
