"""The re-plan an elastic run (`soap execute plan.json --elastic --nnodes MIN:MAX`) does in its workers when
the rendezvous forms a world of another size than the plan's (nodes left or joined).

torch's elastic agent restarts the worker group when a worker dies or membership changes; with
`--nnodes MIN:MAX` the new group has as many nodes as joined the new rendezvous round, so WORLD_SIZE may
differ from the plan's. Each new worker then calls `replan_for_world`: `planner.replan.replan` on the new
rank count (same model, global batch, sequence, precision and optimizer, so the data order continues), and
resumes from the newest checkpoint under the new plan (`executor.train`: DCP reshards). It lives in the
façade because the executor never searches (DESIGN: deciding is separate from applying).

A re-formed group finds its checkpoint by the job (`--rdzv-id`, recorded in the checkpoint's
`soap-run.json`), not by the agents' restart counts, which differ between nodes after a membership change;
each round's workers meet in a store of their own (`executor.launch.fresh_store_per_round`). Every change
of layout is carried from checkpoint to checkpoint, and the run report lists them all (`replans`: old and
new world size and parallelism, the step resumed from).

The ZeRO stage is kept when it is not 1: an elastic run lives by its checkpoints, and ZeRO-1's
ZeroRedundancyOptimizer cannot be checkpointed (`executor.checkpoint`); from zero 1, zero 2 is pinned. torch.compile is kept as it was (a restart should not add a compile).
"""

from __future__ import annotations

from planner.plan import Plan


def replan_for_world(plan: Plan, world_size: int) -> Plan:
    """`plan`'s run re-planned for `world_size` ranks of its own cluster (deterministic: every rank computes
    the same plan)."""
    from planner.replan import replan

    zero = plan.parallelism.zero if plan.parallelism.zero != 1 else 2
    return replan(plan, gpus=world_size, zero=zero, compile=plan.parallelism.compile).new
