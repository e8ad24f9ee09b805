"""The validation suite: small plans on tiny gpt2 / llama / bert configs, built and simulated on a cluster.

Each `SuiteCase` names a model config and a strategy at the suite's world size (2 ranks). `build_case`
traces the config (`tracer.trace`), simulates the strategy on the cluster profile
(`costmodel.simulator.simulate`) and turns the result into a `Plan` (`planner.plan.plan_from_simulation`),
so the executor runs exactly what the simulator priced. Everything is fp32 with AdamW: the precision a
CPU trains in. Sizes are chosen so one step takes roughly 0.1-1 s on one core per rank, and
batch sizes and sequence lengths differ so that the plans' step times spread over several times (a
ranking of near-equal plans would measure noise).

The techniques covered: DDP, FSDP (ZeRO-3), ZeRO-2, TP, TP+SP, PP 1F1B, PP GPipe, activation
checkpointing (full and selective), gradient accumulation, and a 2-D-in-spirit entry (data parallel with
accumulation and checkpointing together) in place of a real 2-D mesh, which needs 4 ranks on this
2-core machine and would only measure oversubscription.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from costmodel.strategy import ParallelDims, Strategy, TrainingConfig

MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": dict(model_type="gpt2", n_embd=192, n_layer=4, n_head=4, vocab_size=2048, n_positions=256,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=0,
                 eos_token_id=0),
    "llama": dict(model_type="llama", hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=2048, max_position_embeddings=256,
                  tie_word_embeddings=False),
    "bert": dict(model_type="bert", hidden_size=192, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=4, vocab_size=2048, max_position_embeddings=256,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
}
TASKS = {"gpt2": "causal-lm", "llama": "causal-lm", "bert": "masked-lm"}


@dataclass(frozen=True, kw_only=True)
class SuiteCase:
    """One plan of the suite."""

    name: str
    """Short label shown in the table, e.g. `gpt2 ddp`."""
    family: str
    """gpt2, llama or bert (a key of MODEL_CONFIGS)."""
    dims: dict[str, int]
    """ParallelDims keywords (dp_replicate, dp_shard, tp, pp); their product is the world size."""
    train: dict[str, Any] = field(default_factory=dict)
    """TrainingConfig keywords besides global_batch/seq_len (micro_batch, num_microbatches, zero, ...)."""
    seq_len: int = 128


def suite_cases() -> list[SuiteCase]:
    """The full suite (12 plans at 2 ranks)."""
    return [
        SuiteCase(name="gpt2 ddp", family="gpt2", dims=dict(dp_replicate=2), train=dict(micro_batch=2)),
        SuiteCase(name="llama fsdp zero3", family="llama", dims=dict(dp_shard=2), train=dict(micro_batch=4, zero=3)),
        SuiteCase(name="bert zero2", family="bert", dims=dict(dp_shard=2), train=dict(micro_batch=2, zero=2),
                  seq_len=64),
        SuiteCase(name="llama tp", family="llama", dims=dict(tp=2), train=dict(micro_batch=8)),
        SuiteCase(name="gpt2 tp+sp", family="gpt2", dims=dict(tp=2), train=dict(micro_batch=4, sequence_parallel=True)),
        SuiteCase(name="llama pp 1f1b", family="llama", dims=dict(pp=2),
                  train=dict(micro_batch=2, num_microbatches=4, schedule="1F1B")),
        SuiteCase(name="llama pp gpipe", family="llama", dims=dict(pp=2),
                  train=dict(micro_batch=2, num_microbatches=4, schedule="GPipe")),
        SuiteCase(name="bert ddp full-ckpt", family="bert", dims=dict(dp_replicate=2),
                  train=dict(micro_batch=8, recompute="full")),
        SuiteCase(name="gpt2 ddp accum4", family="gpt2", dims=dict(dp_replicate=2),
                  train=dict(micro_batch=2, num_microbatches=4, grad_accum=4)),
        SuiteCase(name="llama fsdp selective", family="llama", dims=dict(dp_shard=2),
                  train=dict(micro_batch=4, zero=3, recompute="selective")),
        SuiteCase(name="llama ddp accum+ckpt", family="llama", dims=dict(dp_replicate=2),
                  train=dict(micro_batch=2, num_microbatches=2, grad_accum=2, recompute="full"), seq_len=256),
        SuiteCase(name="bert tp", family="bert", dims=dict(tp=2), train=dict(micro_batch=2), seq_len=64),
    ]


def quick_cases() -> list[SuiteCase]:
    """A 4-plan subset (one per parallelism family) for `soap validate --quick`."""
    keep = {"gpt2 ddp", "llama fsdp zero3", "llama tp", "llama pp 1f1b"}
    return [c for c in suite_cases() if c.name in keep]


def hf_config(family: str) -> dict[str, Any]:
    """The full HF config dict of the family's suite model, as plan.json stores it."""
    from transformers import AutoConfig

    fields = dict(MODEL_CONFIGS[family])
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields).to_dict()


def case_strategy(case: SuiteCase) -> Strategy:
    dims = ParallelDims(**case.dims)
    t = dict(case.train)
    t.setdefault("precision", "fp32")
    t.setdefault("optimizer", "adamw")
    micro, n = t.get("micro_batch", 1), t.get("num_microbatches", 1)
    return Strategy(dims=dims, train=TrainingConfig(global_batch=dims.dp * micro * n, seq_len=case.seq_len, **t))


@dataclass(frozen=True)
class BuiltCase:
    """A suite case traced, simulated and turned into a runnable plan."""

    case: SuiteCase
    plan: Any
    """planner.plan.Plan, with the simulation's metrics under `predicted`."""
    result: Any
    """costmodel.simulator_result.SimResult."""


def build_case(case: SuiteCase, cluster: Any, graphs: dict[tuple[str, int], Any] | None = None) -> BuiltCase:
    """Trace (cached per family and seq_len in `graphs`), simulate and plan one case on `cluster`."""
    import tracer
    from costmodel.simulator import simulate
    from planner.plan import ModelSpecRecord, config_hash, plan_from_simulation

    graphs = {} if graphs is None else graphs
    config = hf_config(case.family)
    key = (case.family, case.seq_len)
    if key not in graphs:
        from transformers import AutoConfig

        fields = dict(MODEL_CONFIGS[case.family])
        graphs[key] = tracer.trace(AutoConfig.for_model(fields.pop("model_type"), **fields),
                                   task=TASKS[case.family], seq_len=case.seq_len)
    graph = graphs[key]
    strategy = case_strategy(case)
    result = simulate(graph, strategy, cluster)
    model = ModelSpecRecord(name=f"suite-{case.family}", source="file", task=TASKS[case.family], config=config,
                            config_hash=config_hash(config))
    plan = plan_from_simulation(model=model, graph=graph, cluster=cluster, strategy=strategy, result=result)
    return BuiltCase(case=case, plan=plan, result=result)


def resimulate(built: BuiltCase, cluster: Any, graphs: dict[tuple[str, int], Any]) -> Any:
    """The SimResult of an already built case under another cluster profile (same plan)."""
    return build_case(built.case, cluster, graphs).result
