"""Issue 33 §3: a run checkpointed under one plan resumes under another, on fewer or more ranks, and
continues exactly as an uninterrupted one-process run on the same data order.

The matrix (tiny llama, global batch 4 x 16 tokens, AdamW, 4 steps; the data of step k is
`TokenSource.batch_for_step(k)` whatever the layout, so the data position is the step count):

    layout  2 ranks                 4 ranks
    DDP     dp_replicate 2          dp_replicate 4
    FSDP    dp_shard 2, zero 3      dp_shard 4, zero 3
    TP      tp 2                    tp 2 x dp_shard 2 (zero 3)
    PP      pp 2 (1F1B, 2 micro)    pp 2 x dp_replicate 2
    CP      cp 2                    cp 2 x dp_shard 2 (zero 3)

1. on 2 ranks, each layout runs steps 0-1 and checkpoints (`from2-L`); each layout also runs steps 0-1
   on 4 ranks (`from4-L`), in the next group;
2. on 4 ranks ("more ranks"), each `from2-L` resumes under the 4-rank layout of the same kind to step 4;
3. on 2 ranks ("fewer ranks"), each `from4-L` resumes under the *next* kind's 2-rank layout (DDP's
   checkpoint under FSDP, ..., CP's under DDP), so every kind is also resumed under a different one.

Each resumed run's losses for steps 2-3 (and each first run's for steps 0-1) equal the one-process run's.
Three process groups (2, 4, 2 ranks) and one 1-rank reference run everything.
"""

from __future__ import annotations

import pytest
from exec_helpers import spawn_cases

pytestmark = pytest.mark.slow

STEPS, SAVED = 4, 2
KINDS = ("ddp", "fsdp", "tp", "pp", "cp")
LAYOUTS = {
    2: {"ddp": dict(dp_replicate=2, micro_batch=2), "fsdp": dict(dp_shard=2, zero=3, micro_batch=2),
        "tp": dict(tp=2, micro_batch=4), "pp": dict(pp=2, micro_batch=2, num_microbatches=2),
        "cp": dict(cp=2, micro_batch=4)},
    4: {"ddp": dict(dp_replicate=4, micro_batch=1), "fsdp": dict(dp_shard=4, zero=3, micro_batch=1),
        "tp": dict(tp=2, dp_shard=2, zero=3, micro_batch=2),
        "pp": dict(pp=2, dp_replicate=2, micro_batch=1, num_microbatches=2),
        "cp": dict(cp=2, dp_shard=2, zero=3, micro_batch=2)},
}
REFERENCE = dict(micro_batch=4)
"""One rank, the whole global batch of 4 in one micro-batch."""


def _case(name: str, plan: dict, **run) -> dict:
    return {"name": name, "family": "llama", "plan": plan, "run": {"seed": 0, **run}}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("resume-matrix")

    def ckpt(name: str) -> str:
        return str(root / name)

    results = spawn_cases(1, [_case("reference", REFERENCE, steps=STEPS)])
    results |= spawn_cases(2, [_case(f"first-2-{k}", LAYOUTS[2][k], steps=SAVED, checkpoint_dir=ckpt(f"from2-{k}"))
                               for k in KINDS])
    results |= spawn_cases(4, [
        *(_case(f"more-{k}", LAYOUTS[4][k], steps=STEPS, checkpoint_dir=ckpt(f"from2-{k}"), resume=True)
          for k in KINDS),
        *(_case(f"first-4-{k}", LAYOUTS[4][k], steps=SAVED, checkpoint_dir=ckpt(f"from4-{k}")) for k in KINDS),
    ])
    results |= spawn_cases(2, [
        _case(f"fewer-{k}", LAYOUTS[2][KINDS[(i + 1) % len(KINDS)]], steps=STEPS, checkpoint_dir=ckpt(f"from4-{k}"),
              resume=True) for i, k in enumerate(KINDS)])
    return results


def _losses(matrix: dict, name: str) -> list[float]:
    got = matrix[name]
    assert isinstance(got, list), f"{name} failed: {got}"
    return got


def test_the_reference_learns(matrix):
    losses = _losses(matrix, "reference")
    assert len(losses) == STEPS and losses[-1] < losses[0]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_the_checkpointed_first_steps_match_one_process(matrix, kind, ranks):
    assert _losses(matrix, f"first-{ranks}-{kind}") == pytest.approx(_losses(matrix, "reference")[:SAVED], rel=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_resuming_on_more_ranks_continues_the_one_process_run(matrix, kind):
    assert _losses(matrix, f"more-{kind}") == pytest.approx(_losses(matrix, "reference")[SAVED:], rel=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_resuming_on_fewer_ranks_under_another_layout_continues_the_one_process_run(matrix, kind):
    assert _losses(matrix, f"fewer-{kind}") == pytest.approx(_losses(matrix, "reference")[SAVED:], rel=1e-4)
