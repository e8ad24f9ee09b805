"""Multi-process executor behaviour on CPU gloo, at 2 and 4 ranks.

- Equivalence: every parallel layout trains exactly like one process: losses over 3 steps from the
  same seed match a single-process run (fp32, relative 1e-4) on tiny llama, gpt2 and bert; also GPT-2's
  tied embeddings split across pipeline stages, optimizer CPU offload, fp16 loss scaling through a
  pipeline and under TP (plain and DTensor gradients in one optimizer; against a single-process fp16
  run), BERT through a pipeline, and vocab-parallel TP over a vocabulary tp does not divide; under
  TP x PP the first stage's token embedding and the last stage's LM head and loss are vocab-parallel
  (GPT-2's tied pair and BERT's too, an uneven vocabulary too); DDP's gradients are views of its buckets
  (fp16 loss scaling and ZeRO-1 gradient accumulation through them too); every pipeline schedule soap
  executes (GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, LoopedBFS, ZBVZeroBubble) with pp=2 x
  dp=2, replicated or ZeRO-3, and ZBVZeroBubble's V with GPT-2's tied pair on one rank.
- Vocab-parallel TP (pp == 1): the token embedding and LM head are sharded over the vocabulary (tied
  ones stay one parameter), the logits come out vocab-sharded, and loss and gradients equal an
  unsharded copy's.
- Communication: for a TP+SP plan (using the simulator's own tp_plan), the collectives CommDebugMode
  counts inside each block and outside them equal those `costmodel.placement.block_placements`
  schedules.
- Resume: 6 steps straight equal 3 steps + resume + 3 steps (losses and final weights).

Starting ranks is the expensive part, so everything at 2 ranks runs inside one group, everything at 4
ranks inside another and TP x PP x DP (8 ranks, one thread each on however few cores) in a third;
each returns its results to the parent through a file (`exec_helpers.spawn_cases`).
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch.distributed as dist
from exec_helpers import init_single_process_group, make_plan, spawn_cases, tiny_config

from executor.train import RunConfig, train

pytestmark = pytest.mark.slow

RUN = {"steps": 3, "lr": 1e-2}
UNTIED = {f: {"config": tiny_config(f, tie_word_embeddings=False)} for f in ("llama", "gpt2")}
DP_2 = {"ddp": dict(dp_replicate=2), "fsdp": dict(dp_shard=2, zero=3), "fsdp2": dict(dp_shard=2, zero=2)}
ODD_VOCAB = {"config": tiny_config("gpt2", vocab_size=95)}
"""A vocabulary tp=2 does not divide: sharded unevenly (48 + 47 rows)."""


def _cases_2_ranks() -> dict[str, tuple[str, dict]]:
    cases: dict[str, tuple[str, dict]] = {}
    for f in ("llama", "gpt2"):
        cases |= {
            f"{f}-ddp": (f, dict(dp_replicate=2, micro_batch=2)),
            f"{f}-zero1": (f, dict(dp_shard=2, zero=1, micro_batch=2)),
            f"{f}-zero2": (f, dict(dp_shard=2, zero=2, micro_batch=2)),
            f"{f}-zero3": (f, dict(dp_shard=2, zero=3, micro_batch=2)),
            f"{f}-tp": (f, dict(tp=2, micro_batch=4)),
            f"{f}-tp-sp": (f, dict(tp=2, micro_batch=4, sequence_parallel=True)),
            f"{f}-cp": (f, dict(cp=2, micro_batch=4)),
            f"{f}-pp-gpipe": (f, dict(pp=2, micro_batch=1, num_microbatches=4, schedule="GPipe", **UNTIED[f])),
            f"{f}-pp-1f1b": (f, dict(pp=2, micro_batch=2, num_microbatches=2, schedule="1F1B", **UNTIED[f])),
            f"{f}-pp-interleaved": (f, dict(pp=2, virtual_stages=2, micro_batch=2, num_microbatches=2,
                                            schedule="Interleaved1F1B", **UNTIED[f])),
            f"{f}-pp-grad-accum": (f, dict(pp=2, micro_batch=1, num_microbatches=4, grad_accum=2, **UNTIED[f])),
            f"{f}-recompute-full": (f, dict(dp_replicate=2, micro_batch=2, recompute="full")),
            f"{f}-recompute-selective": (f, dict(dp_shard=2, zero=3, micro_batch=2, recompute="selective")),
            f"{f}-grad-accum": (f, dict(dp_replicate=2, micro_batch=1, num_microbatches=2)),
        }
    cases |= {
        "gpt2-pp-tied": ("gpt2", dict(pp=2, micro_batch=2, num_microbatches=2)),
        "gpt2-pp-tied-interleaved": ("gpt2", dict(pp=2, virtual_stages=2, micro_batch=2, num_microbatches=2,
                                                  schedule="Interleaved1F1B")),
        "llama-zero3-offload": ("llama", dict(dp_shard=2, zero=3, micro_batch=2, offload_optimizer=True)),
        "llama-pp-fp16": ("llama", dict(pp=2, micro_batch=2, num_microbatches=2, precision="fp16", optimizer="sgd",
                                        **UNTIED["llama"])),
        "llama-tp-fp16": ("llama", dict(tp=2, micro_batch=4, precision="fp16", optimizer="sgd", **UNTIED["llama"])),
        "bert-ddp": ("bert", dict(dp_replicate=2, micro_batch=2)),
        "bert-zero3": ("bert", dict(dp_shard=2, zero=3, micro_batch=2)),
        "bert-tp": ("bert", dict(tp=2, micro_batch=4)),
        # BERT's head bias sits on `cls.predictions`, which no stage names: it must go with the last stage
        "bert-pp-tied-1f1b": ("bert", dict(pp=2, micro_batch=2, num_microbatches=2, schedule="1F1B")),
        "gpt2-tp-vocab-95": ("gpt2", dict(tp=2, micro_batch=4, **ODD_VOCAB)),
        # a plan written before the chunked cross-entropy: torch's vocab-parallel loss in loss_parallel()
        "gpt2-tp-vocab-95-upcast": ("gpt2", dict(tp=2, micro_batch=4, cross_entropy="upcast", **ODD_VOCAB)),
        # DDP's gradients are views of its buckets: unscaled in place, accumulated under no_sync
        "llama-ddp-fp16": ("llama", dict(dp_replicate=2, micro_batch=2, precision="fp16", optimizer="sgd",
                                         **UNTIED["llama"])),
        "llama-zero1-grad-accum": ("llama", dict(dp_shard=2, zero=1, micro_batch=1, num_microbatches=2)),
        # selective checkpointing's matmul count under DTensor ops and inside pipeline stages
        "llama-tp-sp-selective": ("llama", dict(tp=2, micro_batch=4, sequence_parallel=True, recompute="selective")),
        "gpt2-pp-selective": ("gpt2", dict(pp=2, micro_batch=2, num_microbatches=2, recompute="selective",
                                           **UNTIED["gpt2"])),
    }
    return cases


def _cases_4_ranks() -> dict[str, tuple[str, dict]]:
    cases: dict[str, tuple[str, dict]] = {}
    for f in ("llama", "gpt2"):
        cases |= {
            f"{f}-fsdp-x-tp": (f, dict(dp_shard=2, zero=3, tp=2, micro_batch=2)),
            f"{f}-pp-x-dp": (f, dict(pp=2, dp_replicate=2, micro_batch=1, num_microbatches=2, **UNTIED[f])),
            f"{f}-tp-x-pp": (f, dict(tp=2, pp=2, micro_batch=2, num_microbatches=2, **UNTIED[f])),
            f"{f}-tp-sp-x-pp": (f, dict(tp=2, pp=2, sequence_parallel=True, micro_batch=2, num_microbatches=2,
                                        **UNTIED[f])),
        }
    cases |= {
        "llama-hsdp": ("llama", dict(dp_replicate=2, dp_shard=2, zero=3, micro_batch=1)),
        "llama-cp-x-fsdp": ("llama", dict(cp=2, dp_shard=2, zero=3, micro_batch=2)),
        "bert-fsdp-x-tp": ("bert", dict(dp_shard=2, zero=3, tp=2, micro_batch=2)),
        "gpt2-pp-tied-x-fsdp": ("gpt2", dict(pp=2, dp_shard=2, zero=3, micro_batch=1, num_microbatches=2)),
        "gpt2-tp-x-pp-tied": ("gpt2", dict(tp=2, pp=2, micro_batch=2, num_microbatches=2)),
        # vocab-parallel ends on pipeline stages: tied across them, over an uneven vocabulary, BERT's head
        "gpt2-tp-x-pp-tied-vocab-95": ("gpt2", dict(tp=2, pp=2, micro_batch=2, num_microbatches=2, **ODD_VOCAB)),
        "bert-tp-x-pp": ("bert", dict(tp=2, pp=2, micro_batch=2, num_microbatches=2)),
        "bert-tp-x-pp-upcast": ("bert", dict(tp=2, pp=2, micro_batch=2, num_microbatches=2, cross_entropy="upcast")),
    }
    # every executed schedule with pp=2 x dp=2 (1F1B above: llama-pp-x-dp, gpt2-pp-tied-x-fsdp); the
    # zero-bubble ones under FSDP ZeRO-2 (ZeRO-3 is refused there: costmodel.plan_rules), whose weight
    # backward runs after later forwards
    cases |= {
        f"llama-pp-{name}-x-{dp}": ("llama", dict(pp=2, micro_batch=1, num_microbatches=2, schedule=schedule,
                                                   virtual_stages=v, **DP_2[dp], **UNTIED["llama"]))
        for name, schedule, v, dp in (("gpipe", "GPipe", 1, "fsdp"), ("interleaved", "Interleaved1F1B", 2, "fsdp"),
                                      ("izb", "InterleavedZeroBubble", 2, "ddp"),
                                      ("izb", "InterleavedZeroBubble", 2, "fsdp2"),
                                      ("looped-bfs", "LoopedBFS", 2, "ddp"), ("zbv", "ZBVZeroBubble", 2, "fsdp2"))
    }
    # ZBV's V puts the first and the last stage on one rank: GPT-2's tied pair is summed there
    cases["gpt2-pp-zbv-tied-x-ddp"] = ("gpt2", dict(pp=2, dp_replicate=2, micro_batch=1, num_microbatches=2,
                                                    schedule="ZBVZeroBubble", virtual_stages=2))
    return cases


def _cases_8_ranks() -> dict[str, tuple[str, dict]]:
    return {
        "llama-tp-x-pp-x-fsdp": ("llama", dict(tp=2, pp=2, dp_shard=2, zero=3, micro_batch=1, num_microbatches=2,
                                               **UNTIED["llama"])),
        "gpt2-tp-sp-x-pp-x-ddp": ("gpt2", dict(tp=2, pp=2, dp_replicate=2, sequence_parallel=True, micro_batch=1,
                                               num_microbatches=2, **UNTIED["gpt2"])),
    }


def _spawn(world: int, cases: dict[str, tuple[str, dict]], extra: tuple[dict, ...] = ()) -> dict:
    payload = [{"name": n, "family": f, "plan": kw, "run": RUN} for n, (f, kw) in cases.items()] + list(extra)
    return spawn_cases(world, payload)


@pytest.fixture(scope="module")
def single_process_losses() -> dict[str, list[float]]:
    init_single_process_group()
    try:
        refs = {f: train(make_plan(f, micro_batch=4), RunConfig(progress=False, **RUN)).losses
                for f in ("llama", "gpt2", "bert")}
        for f in ("llama", "gpt2"):
            refs[f"{f}-untied"] = train(make_plan(f, micro_batch=4, **UNTIED[f]), RunConfig(progress=False, **RUN)).losses
        refs["gpt2-vocab-95"] = train(make_plan("gpt2", micro_batch=4, **ODD_VOCAB), RunConfig(progress=False, **RUN)).losses
        # SGD, unlike AdamW, would show gradients left multiplied by the loss scale
        refs["llama-untied-fp16-sgd"] = train(make_plan("llama", micro_batch=4, precision="fp16", optimizer="sgd",
                                                        **UNTIED["llama"]), RunConfig(progress=False, **RUN)).losses
    finally:
        dist.destroy_process_group()
    return refs


def _simulated_tp_plan_and_block_collectives() -> tuple[dict[str, str], collections.Counter, dict[str, collections.Counter],
                                                       tuple]:
    """The simulator's tp_plan, per-block collectives, the collectives of the ops outside the blocks (by
    op name) and the names of the token embedding and LM head, for the tiny llama TP2+SP plan."""
    import tracer
    from costmodel.placement import ActivationShape, block_placements, tp_plan, vocab_parallel_ops
    from transformers import AutoConfig

    fields = tiny_config("llama")
    graph = tracer.trace(AutoConfig.for_model(fields.pop("model_type"), **fields), batch=4, seq_len=16)
    strategy = make_plan("llama", **COMM_PLAN).strategy()
    shape = ActivationShape(micro_batch=4, seq_len=16, hidden=32, itemsize=4)
    block = [op for op in graph.ops if op.block_id == "model.layers"]
    placed = block_placements(block, strategy, shape)
    counts = collections.Counter((c.kind, c.phase) for p in placed for c in p.collectives if c.group == "tp")
    outside: dict[str, collections.Counter] = {}
    for segment in graph.segments():
        if segment.block_id is None:
            for p in block_placements(segment.ops, strategy, shape):
                outside[p.op.name] = collections.Counter((c.kind, c.phase) for c in p.collectives if c.group == "tp")
    return tp_plan(block, strategy), counts, outside, vocab_parallel_ops(graph.ops)


ORDER_PLANS = {
    "GPipe": dict(pp=2, micro_batch=1, num_microbatches=4, schedule="GPipe", **UNTIED["llama"]),
    "1F1B": dict(pp=2, micro_batch=1, num_microbatches=4, schedule="1F1B", **UNTIED["llama"]),
    "Interleaved1F1B": dict(pp=2, virtual_stages=2, micro_batch=1, num_microbatches=4,
                            schedule="Interleaved1F1B", **UNTIED["llama"]),
}
COMM_PLAN = dict(tp=2, micro_batch=4, sequence_parallel=True)
VOCAB_PLAN = dict(tp=2, micro_batch=4)
VOCAB_CASES = {"gpt2": {}, "llama": {}, "bert": {}, "gpt2-vocab-95": ODD_VOCAB}
RESUME_PLAN = dict(dp_shard=2, zero=3, micro_batch=2)


@pytest.fixture(scope="module")
def resume_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resume")
    return {"straight": root / "straight", "split": root / "split"}


@pytest.fixture(scope="module")
def simulated() -> tuple:
    return _simulated_tp_plan_and_block_collectives()


@pytest.fixture(scope="module")
def two_rank_losses(resume_dirs, simulated) -> dict:
    sim_tp_plan = simulated[0]
    straight, split = str(resume_dirs["straight"]), str(resume_dirs["split"])
    extra = (
        {"name": "comm-tp-sp", "family": "llama", "plan": {**COMM_PLAN, "tp_plan": sim_tp_plan},
         "run": {"steps": 1}, "count_block_collectives": True},
        *({"name": f"order-{name}", "family": "llama", "plan": kwargs, "run": {"steps": 2},
           "record_pipeline_order": True} for name, kwargs in ORDER_PLANS.items()),
        *({"name": f"vocab-{name}", "family": name.split("-")[0], "plan": {**VOCAB_PLAN, **kwargs},
           "inspect_vocab_parallel": True} for name, kwargs in VOCAB_CASES.items()),
        {"name": "resume-straight", "family": "llama", "plan": RESUME_PLAN,
         "run": {**RUN, "steps": 6, "checkpoint_dir": straight, "checkpoint_every": 3}},
        {"name": "resume-first", "family": "llama", "plan": RESUME_PLAN,
         "run": {**RUN, "steps": 3, "checkpoint_dir": split}},
        {"name": "resume-second", "family": "llama", "plan": RESUME_PLAN,
         "run": {**RUN, "steps": 6, "checkpoint_dir": split, "resume": True}},
    )
    return _spawn(2, _cases_2_ranks(), extra)


@pytest.fixture(scope="module")
def four_rank_losses() -> dict:
    return _spawn(4, _cases_4_ranks())


@pytest.fixture(scope="module")
def eight_rank_losses() -> dict:
    return _spawn(8, _cases_8_ranks())


def _reference(name: str, family: str, kwargs: dict, refs: dict) -> list[float]:
    config = kwargs.get("config")
    key = (family if config is None else f"{family}-untied" if not config.get("tie_word_embeddings", True)
           else f"{family}-vocab-{config['vocab_size']}")
    if kwargs.get("precision") == "fp16":
        key += f"-fp16-{kwargs['optimizer']}"
    return refs[key]


def _check(name: str, got, expected: list[float]) -> None:
    assert isinstance(got, list), f"{name} failed: {got}"
    assert got == pytest.approx(expected, rel=1e-4), name


@pytest.mark.parametrize("name", list(_cases_2_ranks()))
def test_two_rank_layout_matches_single_process(name, two_rank_losses, single_process_losses):
    family, kwargs = _cases_2_ranks()[name]
    _check(name, two_rank_losses[name], _reference(name, family, kwargs, single_process_losses))


@pytest.mark.parametrize("name", list(_cases_4_ranks()))
def test_four_rank_layout_matches_single_process(name, four_rank_losses, single_process_losses):
    family, kwargs = _cases_4_ranks()[name]
    _check(name, four_rank_losses[name], _reference(name, family, kwargs, single_process_losses))


@pytest.mark.parametrize("name", list(_cases_8_ranks()))
def test_tp_x_pp_x_dp_matches_single_process(name, eight_rank_losses, single_process_losses):
    family, kwargs = _cases_8_ranks()[name]
    _check(name, eight_rank_losses[name], _reference(name, family, kwargs, single_process_losses))


def test_losses_change_between_steps(single_process_losses):
    """The equivalence is not vacuous: training moves the loss, so a wrong gradient would show."""
    for losses in single_process_losses.values():
        assert len(set(round(x, 6) for x in losses)) == 3


def test_tp_sp_block_collectives_equal_the_simulated_ones(two_rank_losses, simulated):
    """CommDebugMode's counts = the simulator's collectives. Per block: the block's own, plus the
    sequence-parallel boundary, which the simulator prices on the ops outside the blocks: the token
    embedding's backward all-gather (the executor slices the embedding output at the first block) and
    the LM head's forward all-gather (it gathers the last block's output). Outside the blocks the
    all-reduces: the vocab-parallel embedding (forward), the LM head's input gradient (backward) and
    the vocab-parallel loss (three forward), besides the per-step all-reduce of the sequence-parallel
    norm weights' gradients (2 per block)."""
    measured = two_rank_losses["comm-tp-sp"]
    assert isinstance(measured, dict), measured
    _, expected, outside, (embedding, head) = simulated
    assert sum(expected.values()) == 8  # 2 TP regions x (fwd AG + RS, bwd RS + AG)
    assert (embedding, head) == ("model.embed_tokens:embedding", "lm_head:linear")
    gathers = {name: collections.Counter({k: n for k, n in c.items() if k[0] == "all_gather"}) for name, c in outside.items()}
    assert gathers[embedding] == {("all_gather", "bwd"): 1} and gathers[head] == {("all_gather", "fwd"): 1}
    assert sum(sum(c.values()) for name, c in gathers.items() if name not in (embedding, head)) == 0
    blocks = sorted((k for k in measured if k != "total"), key=lambda k: int(k.rsplit(".", 1)[1]))
    assert len(blocks) == 4
    names = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}
    for i, block in enumerate(blocks):
        got = collections.Counter({(names[op], "fwd" if phase == "forward" else "bwd"): n
                                   for phase, ops in measured[block].items() for op, n in ops.items()})
        boundary = (gathers[embedding] if i == 0 else collections.Counter()) + \
            (gathers[head] if i == len(blocks) - 1 else collections.Counter())
        assert got == expected + boundary, block
    simulated_all_reduces = sum(n for c in outside.values() for (kind, _), n in c.items() if kind == "all_reduce")
    assert simulated_all_reduces == 5  # embedding, head input gradient, loss max / sum / target logit
    # the loss report and the peak-memory gather are plain c10d calls (allreduce_, allgather_), apart
    assert measured["total"]["all_reduce"] == 2 * len(blocks) + simulated_all_reduces


@pytest.mark.parametrize("name", list(VOCAB_CASES))
def test_tp_shards_the_token_embedding_and_lm_head_over_the_vocabulary(name, two_rank_losses):
    """2-rank TP: the token embedding and LM head weights are Shard(0) DTensors (one tied parameter for
    GPT-2 and BERT, BERT's decoder-bias alias kept), the logits come out sharded on the vocabulary,
    position / token-type embeddings stay plain, and one vocab-parallel forward/backward gives the loss
    and the embedding / head gradients of an unsharded copy (tied: the sum of both uses)."""
    got = two_rank_losses[f"vocab-{name}"]
    assert isinstance(got, dict), got
    assert got["embedding"] == got["head"] == ["S(0)"]
    assert got["logits"] == ["S(2)"] and got["logits_local_vocab"] == 48  # rank 0's shard of 96 or 95
    assert set(got["other_embeddings"].values()) <= {"plain"} and bool(got["other_embeddings"]) is (name != "llama")
    assert got["tied"] is (name != "llama") and got["aliases"]
    assert got["parameters"] == got["reference_parameters"]
    assert got["loss_error"] < 1e-5
    assert got["embedding_grad_error"] < 1e-6 and got["head_grad_error"] < 1e-6


def test_resume_continues_exactly(two_rank_losses, resume_dirs):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    import torch

    straight, first, second = (two_rank_losses[k] for k in ("resume-straight", "resume-first", "resume-second"))
    for result in (straight, first, second):
        assert isinstance(result, list), result
    assert len(second) == 3
    assert first == pytest.approx(straight[:3], rel=1e-6)
    assert second == pytest.approx(straight[3:], rel=1e-6)
    weights = {}
    for name, root in resume_dirs.items():
        assert (root / "latest").read_text().strip() == "step-00000006"
        assert not list(root.glob(".tmp-*")) and len(list(root.glob("step-*"))) == 1
        dcp_to_torch_save(root / "step-00000006", root / "full.pt")
        weights[name] = torch.load(root / "full.pt", weights_only=True)
    model_keys = [k for k in weights["straight"] if k.startswith("model.")]
    assert len(model_keys) > 10
    for key in weights["straight"]:
        torch.testing.assert_close(weights["split"][key], weights["straight"][key], rtol=0, atol=0)


@pytest.mark.parametrize("schedule", list(ORDER_PLANS))
def test_pipeline_runs_the_schedule_ir_order(schedule, two_rank_losses):
    """The forward/backward order each pipeline rank really ran equals costmodel.schedule's IR, which
    the simulator prices."""
    from costmodel.schedule import build_schedule

    recorded = two_rank_losses[f"order-{schedule}"]
    assert isinstance(recorded, list), recorded
    kwargs = ORDER_PLANS[schedule]
    ir = build_schedule(schedule, kwargs["pp"], kwargs["num_microbatches"], kwargs.get("virtual_stages", 1))
    for rank, ran in enumerate(recorded):
        assert ran == [str(a) for a in ir.actions[rank] if a.is_compute], f"rank {rank}"
