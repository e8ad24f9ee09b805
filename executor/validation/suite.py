"""The validation suite: small plans on tiny gpt2 / llama / bert configs, built and simulated on a cluster.

Each `SuiteCase` names a model config and a strategy at the suite's world size (2 ranks). `build_case`
traces the config (`tracer.trace`), simulates the strategy on the cluster profile
(`costmodel.simulator.simulate`) and turns the result into a `Plan` (`planner.plan.plan_from_simulation`),
so the executor runs exactly what the simulator priced. Everything is fp32 with AdamW: the precision a
CPU trains in. Sizes are chosen so one step takes roughly 0.1-1 s on one core per rank, and
batch sizes and sequence lengths differ so that the plans' step times spread over several times (a
ranking of near-equal plans would measure noise).

The techniques covered: DDP, FSDP (ZeRO-3), ZeRO-2, TP, TP+SP, PP 1F1B, PP GPipe, activation
checkpointing (full and selective), gradient accumulation (also with checkpointing), and a real 2-D mesh
(`two_d_cases`: FSDP x TP on 4 ranks, two per core here, which the profile's `concurrency_efficiency`
prices).

`calibration_cases()` are other plans on other models (`soap validate --suite calibration`), for
`soap calibrate --from-runs` to refit the profile from without seeing any suite plan.

`single_device_cases(device)` is the suite at one rank (`soap validate --nproc 1`): plain training,
full and selective checkpointing, accumulation and several micro-batch sizes across the three families.
On CUDA the models are larger (hidden 1024-2048, 8 layers, vocab 32k, seq 512-1024, bf16) so that a step
takes tens of milliseconds on one GPU and measures kernels rather than launch overhead.
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
CUDA_MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": dict(MODEL_CONFIGS["gpt2"], n_embd=1024, n_layer=8, n_head=16, vocab_size=32000, n_positions=1024),
    "llama": dict(MODEL_CONFIGS["llama"], hidden_size=2048, intermediate_size=5504, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=1024),
    "bert": dict(MODEL_CONFIGS["bert"], hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                 num_attention_heads=16, vocab_size=32000, max_position_embeddings=512),
}
"""The single-GPU suite's models: big enough that one step is 20-200 ms of kernels on an H100."""
CALIBRATION_MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": dict(MODEL_CONFIGS["gpt2"], n_embd=256, n_layer=3, vocab_size=3072),
    "llama": dict(MODEL_CONFIGS["llama"], hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                  num_key_value_heads=4, vocab_size=3072),
    "bert": dict(MODEL_CONFIGS["bert"], hidden_size=256, intermediate_size=1024, num_hidden_layers=3,
                 vocab_size=3072),
}
"""The calibration plans' models: other widths, depths, vocabularies and head layouts than the suite's, so
that a profile refitted from their runs is judged on the suite as on unseen models."""
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
    size: str = "small"
    """Model size: "small" (MODEL_CONFIGS, CPU), "cuda" (CUDA_MODEL_CONFIGS, one GPU) or "calibration"
    (CALIBRATION_MODEL_CONFIGS, the calibration plans)."""

    model_overrides: dict[str, Any] = field(default_factory=dict)
    """Config fields that differ from the family's at this size (a narrower model, say)."""

    def model_fields(self) -> dict[str, Any]:
        """The family's config fields at this case's size (model_type included)."""
        configs = {"cuda": CUDA_MODEL_CONFIGS, "calibration": CALIBRATION_MODEL_CONFIGS}.get(self.size, MODEL_CONFIGS)
        return {**configs[self.family], **self.model_overrides}


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


def two_d_cases() -> list[SuiteCase]:
    """A real 2-D mesh (FSDP x TP) needs 4 ranks: on this 2-core machine two ranks share each core, which
    the profile prices as data (`concurrency_efficiency` at 4 processes), so it runs in a group of its own."""
    return [SuiteCase(name="llama fsdp x tp (4 ranks)", family="llama", dims=dict(dp_shard=2, tp=2),
                      train=dict(micro_batch=4, zero=3))]


def calibration_cases() -> list[SuiteCase]:
    """Plans for `soap calibrate --from-runs` to learn from (`soap validate --suite calibration`): the
    suite's techniques on other models (CALIBRATION_MODEL_CONFIGS) with other batch shapes, none of them a
    suite plan, so the suite stays held out from a profile refitted on their runs (11 plans at 2 ranks)."""
    plans = [
        ("calib gpt2 ddp", "gpt2", dict(dp_replicate=2), dict(micro_batch=4), 64),
        ("calib llama ddp", "llama", dict(dp_replicate=2), dict(micro_batch=1), 256),
        ("calib bert fsdp zero3", "bert", dict(dp_shard=2), dict(micro_batch=4, zero=3), 128),
        ("calib gpt2 zero2 accum2", "gpt2", dict(dp_shard=2), dict(micro_batch=2, num_microbatches=2, grad_accum=2,
                                                                    zero=2), 128),
        ("calib gpt2 tp", "gpt2", dict(tp=2), dict(micro_batch=2), 256),
        ("calib llama tp+sp", "llama", dict(tp=2), dict(micro_batch=4, sequence_parallel=True), 128),
        ("calib bert pp 1f1b", "bert", dict(pp=2), dict(micro_batch=4, num_microbatches=4, schedule="1F1B"), 64),
        ("calib gpt2 pp gpipe", "gpt2", dict(pp=2), dict(micro_batch=1, num_microbatches=4, schedule="GPipe"), 256),
        ("calib llama fsdp full-ckpt", "llama", dict(dp_shard=2), dict(micro_batch=4, zero=3, recompute="full"), 128),
        ("calib bert ddp selective", "bert", dict(dp_replicate=2), dict(micro_batch=4, recompute="selective"), 128),
    ]
    cases = [SuiteCase(name=name, family=family, dims=dims, train=train, seq_len=seq, size="calibration")
             for name, family, dims, train, seq in plans]
    # Overhead-bound: so narrow that the step is per-op host time (dispatch, autograd, modules), which the
    # wider plans cannot tell apart from compute.
    narrow = dict(n_embd=32, n_head=2, n_layer=4)
    return cases + [SuiteCase(name="calib gpt2 narrow ddp", family="gpt2", dims=dict(dp_replicate=2),
                              train=dict(micro_batch=2), seq_len=32, size="calibration", model_overrides=narrow)]


def quick_cases() -> list[SuiteCase]:
    """A 4-plan subset (one per parallelism family) for `soap validate --quick`."""
    keep = {"gpt2 ddp", "llama fsdp zero3", "llama tp", "llama pp 1f1b"}
    return [c for c in suite_cases() if c.name in keep]


def single_device_cases(device: str) -> list[SuiteCase]:
    """The suite at one rank: small fp32 models on CPU, larger bf16 models on CUDA (10 plans)."""
    if device == "cuda":
        precision, size = "bf16", "cuda"
        plans = [("gpt2 plain", "gpt2", dict(micro_batch=16), 1024),
                 ("llama plain", "llama", dict(micro_batch=8), 512),
                 ("bert plain", "bert", dict(micro_batch=32), 512),
                 ("llama full-ckpt", "llama", dict(micro_batch=8, recompute="full"), 512),
                 ("gpt2 selective-ckpt", "gpt2", dict(micro_batch=16, recompute="selective"), 1024),
                 ("llama accum4", "llama", dict(micro_batch=4, num_microbatches=4, grad_accum=4), 512),
                 ("bert accum2+ckpt", "bert", dict(micro_batch=32, num_microbatches=2, grad_accum=2,
                                                   recompute="full"), 512),
                 ("gpt2 micro-batch 8", "gpt2", dict(micro_batch=8), 1024),
                 ("llama micro-batch 2", "llama", dict(micro_batch=2), 1024),
                 ("bert selective-ckpt", "bert", dict(micro_batch=64, recompute="selective"), 256)]
    else:
        precision, size = "fp32", "small"
        plans = [("gpt2 plain", "gpt2", dict(micro_batch=4), 128),
                 ("llama plain", "llama", dict(micro_batch=2), 256),
                 ("bert plain", "bert", dict(micro_batch=8), 64),
                 ("llama full-ckpt", "llama", dict(micro_batch=8, recompute="full"), 128),
                 ("gpt2 selective-ckpt", "gpt2", dict(micro_batch=8, recompute="selective"), 128),
                 ("llama accum4", "llama", dict(micro_batch=2, num_microbatches=4, grad_accum=4), 128),
                 ("bert accum2+ckpt", "bert", dict(micro_batch=8, num_microbatches=2, grad_accum=2,
                                                   recompute="full"), 64),
                 ("gpt2 micro-batch 1", "gpt2", dict(micro_batch=1), 256),
                 ("llama micro-batch 16", "llama", dict(micro_batch=16), 64),
                 ("bert selective-ckpt", "bert", dict(micro_batch=4, recompute="selective"), 128)]
    return [SuiteCase(name=name, family=family, dims={}, train=dict(train, precision=precision), seq_len=seq,
                      size=size) for name, family, train, seq in plans]


def quick_single_device_cases(device: str) -> list[SuiteCase]:
    """A 4-plan single-device subset: plain, checkpointing, accumulation, one per family at least."""
    keep = {"gpt2 plain", "llama full-ckpt", "bert accum2+ckpt", "llama accum4"}
    return [c for c in single_device_cases(device) if c.name in keep]


def hf_config(case: SuiteCase) -> dict[str, Any]:
    """The full HF config dict of the case's model, as plan.json stores it."""
    from transformers import AutoConfig

    fields = case.model_fields()
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
    """costmodel.simulator.result.SimResult."""
    workspace_bytes: int = 0
    """The cluster's device runtime workspace (`DeviceProfile.runtime_workspace_bytes`)."""


def build_case(case: SuiteCase, cluster: Any, graphs: dict[tuple, Any] | None = None) -> BuiltCase:
    """Trace (cached per family, seq_len, size and trace dtype in `graphs`), simulate and plan one case on `cluster`."""
    import tracer
    from costmodel.simulator import simulate
    from planner.plan import ModelSpecRecord, config_hash, plan_from_simulation
    from planner.regimes import regime_dtype

    graphs = {} if graphs is None else graphs
    config = hf_config(case)
    strategy = case_strategy(case)
    dtype = regime_dtype(strategy.dims, strategy.train, cluster.device)  # the trace of the run's precision regime
    key = (case.family, case.seq_len, case.size, dtype, tuple(sorted(case.model_overrides.items())))
    if key not in graphs:
        from transformers import AutoConfig

        fields = case.model_fields()
        graphs[key] = tracer.trace(AutoConfig.for_model(fields.pop("model_type"), **fields),
                                   task=TASKS[case.family], seq_len=case.seq_len, dtype=dtype)
    graph = graphs[key]
    result = simulate(graph, strategy, cluster)
    model = ModelSpecRecord(name=f"{'calib' if case.size == 'calibration' else 'suite'}-{case.family}", source="file", task=TASKS[case.family], config=config,
                            config_hash=config_hash(config))
    plan = plan_from_simulation(model=model, graph=graph, cluster=cluster, strategy=strategy, result=result)
    return BuiltCase(case=case, plan=plan, result=result, workspace_bytes=cluster.device.runtime_workspace_bytes)


def resimulate(built: BuiltCase, cluster: Any, graphs: dict[tuple, Any]) -> Any:
    """The SimResult of an already built case under another cluster profile (same plan)."""
    return build_case(built.case, cluster, graphs).result
