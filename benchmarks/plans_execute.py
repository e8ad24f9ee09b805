"""Benchmark and property test: every plan soap writes executes (issues 15 and 26).

    python -m benchmarks.plans_execute [--cases 200] [--seed 0] [--no-compile]

Draws random tiny models (llama, gpt2, bert, t5, mixtral: random widths, heads, KV heads, layers,
vocabularies including odd ones, experts and top-k), a world of 1-4 ranks, a node size (small "nodes"
of 1 or 2 ranks make TP and other groups span nodes) and random pins from the whole product (several
of tp, pp, dp, cp, ep whose product divides the world, schedule, virtual stages, zero, recompute,
compile, offload, micro-batch, gradient accumulation, precision fp32/bf16/fp8, optimizer, the loss (chunked or
upcast cross-entropy), and PEFT: LoRA or QLoRA adapters, whose refusals
`costmodel.plan_rules.peft_violation` states; compile is drawn with the schedules that split the
backward too), all from one seed; what is not pinned the planner searches. For each:
1. `soap plan` (`planner.api.plan_report` on the `local-cpu` cluster): a plan, or a refusal, which must
   be a `SoapError` (the `error:` line), never another exception;
2. the plan goes through plan.json (`Plan.to_json` -> `plan_from_dict`, the loader's rules) and the
   launcher's pre-spawn check (`executor.launch.check_plan_rules`);
3. it trains 2 steps on its world of gloo ranks (`executor.train.train`, what every `soap execute`
   worker runs), all plans of one world size in one process group;
4. fp32 plans must reproduce the losses of the same model's 1-rank fp32 eager plan (relative 1e-4,
   SGD: see COMPARE_LR), with the same adapters where the case has them: a parallel layout, or compile,
   changes where the arithmetic runs, not the training.

`tests/test_plans_execute.py` runs a CI-sized sample (fixed seed); this script runs a larger one and
prints one line per case plus the counts, and writes section `plans-execute` of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FAMILIES = ("llama", "gpt2", "bert", "t5", "mixtral")
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS", "ZBVZeroBubble")
STEPS = 2
REL = 1e-4
COMPARE_LR = {"sgd": 0.1}
"""Learning rates of the compared (fp32) runs: AdamW's first step is about lr * sign(gradient), which
turns rounding noise in near-zero gradients into whole-lr differences and hides a wrongly scaled
gradient; SGD at 0.1 moves the second step's loss by its gradients' true size. Others run at 1e-3."""
PEFT_COMPARE_LR = {"sgd": 0.01}
"""With adapters, SGD at 0.01: LoRA's first step moves only B (A's gradient is zero while B is), scaled by
alpha / rank; at 0.1 one step took a T5's B to 21, whose unscaled attention then turned the 6e-6 fp32 rounding
of accumulated micro-batches (a plan of 4 x 2 against 8 x 1, one process) into 0.25% on the second loss."""


@dataclass
class Case:
    name: str
    family: str
    config: dict[str, Any]
    world: int
    pins: dict[str, Any]
    global_batch: int
    seq_len: int
    plan: dict[str, Any] | None = None
    """plan.json's content, once planned."""
    reference: dict[str, Any] | None = None
    """The same model's 1-rank fp32 plan (for fp32 plans)."""
    gpus_per_node: int | None = None
    """`--gpus-per-node` (None: the cluster's); below the world, groups span "nodes"."""
    outcome: str = ""
    """`refused: ...`, `ran`, `failed: ...` or `mismatch: ...`."""
    losses: list[float] = field(default_factory=list)


def random_config(rng: random.Random, family: str) -> dict[str, Any]:
    """A tiny HF config dict of `family` (model_type included), random in the shapes that splits care about."""
    heads = rng.choice((2, 4))
    head_dim = rng.choice((8, 16))
    hidden = heads * head_dim
    layers = rng.choice((2, 3, 4))
    vocab = rng.choice((64, 95, 96, 128))
    if family in ("llama", "mixtral"):
        config = dict(model_type=family, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=rng.choice([k for k in (1, 2, 4) if heads % k == 0]),
                      vocab_size=vocab, max_position_embeddings=64, tie_word_embeddings=rng.random() < 0.3)
        if family == "mixtral":
            experts = rng.choice((2, 4))
            config |= dict(num_local_experts=experts, num_experts_per_tok=rng.choice((1, 2)), router_jitter_noise=0.0,
                           tie_word_embeddings=False)
        return config
    if family == "gpt2":
        return dict(model_type="gpt2", n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab, n_positions=64,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=0,
                    eos_token_id=0)
    if family == "bert":
        return dict(model_type="bert", hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                    num_attention_heads=heads, vocab_size=vocab, max_position_embeddings=64,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if family == "t5":
        return dict(model_type="t5", d_model=hidden, d_ff=2 * hidden, d_kv=head_dim, num_heads=heads, num_layers=layers,
                    num_decoder_layers=rng.choice((1, layers)), vocab_size=vocab, dropout_rate=0.0,
                    decoder_start_token_id=0, pad_token_id=0)
    raise ValueError(family)


FOCUS = ("pp", "tp", "compile", "zero", "cp", "dp", "ep", "virtual_stages", "offload", "schedule", "recompute",
         "micro_batch", "peft")
"""Case i pins FOCUS[i % len(FOCUS)] first (where the planner offers it and the model allows it), so
that any thirteen consecutive cases pin every dimension once; the rest is drawn at random. In the first
thirteen, t5 (FAMILIES[3], data-parallel only) draws zero and offload."""
PEFT_SHARE = 0.1
"""Of the cases whose focus is not PEFT, the share that fine-tunes with adapters too (its other pins drawn as
for any case, so LoRA meets pipelines, ZeRO, recompute, precision and the planner's refusals)."""
PEFT_METHODS = ("lora", "lora", "qlora")
"""QLoRA's 4-bit base runs on bitsandbytes' CPU backend here (tests/test_peft_execute.py)."""
DEGREES = ("tp", "pp", "dp", "cp", "ep")
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble")


def _shape(config: dict[str, Any]) -> tuple[int, int, int, int]:
    """(attention heads, KV heads, layers, experts) of a tiny config."""
    heads = config.get("num_attention_heads", config.get("n_head", config.get("num_heads", 1)))
    layers = config.get("num_hidden_layers", config.get("n_layer", config.get("num_layers", 1)))
    return heads, config.get("num_key_value_heads", heads), layers, config.get("num_local_experts", 0)


def random_pins(rng: random.Random, world: int, config: dict[str, Any], allowed: frozenset[str],
                focus: str | None = None, seq_len: int = 16) -> dict[str, Any]:
    """`focus` and up to three more pins a user might try on `world` ranks, drawn from the whole product
    (parallel degrees whose product divides the world, schedule and virtual stages, ZeRO, recompute,
    compile, offload, micro-batch, precision), each a value the model's shape admits (tp divides the
    heads and meets the KV heads, pp at most the layers, ...) so that most cases yield a plan; what is
    not pinned the planner searches."""
    heads, kv_heads, layers, experts = _shape(config)
    divisors = [d for d in range(2, world + 1) if world % d == 0]
    degree_values = {
        "tp": [d for d in divisors if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)],
        "pp": [d for d in divisors if d <= layers],
        "dp": divisors,
        "cp": [d for d in divisors if seq_len % (2 * d) == 0],
        "ep": [d for d in divisors if experts and experts % d == 0],
    }
    encoder_decoder = config["model_type"] == "t5"
    options: dict[str, Any] = {
        # fp8 is planned for H100s and runs torchao's emulated float8 on the CPU ranks (plan_case)
        "precision": lambda: rng.choice(("fp32", "fp32", "bf16", "fp8")),
        "optimizer": lambda: rng.choice(("adamw", "adafactor", "adamw8bit")),  # fp32 cases compare under SGD
        "cross_entropy": lambda: rng.choice(("chunked", "upcast")),
        "grad_accum": lambda: 2,
        # encoder-decoders train without recompute (costmodel.plan_rules.recompute_violation)
        "recompute": lambda: "none" if encoder_decoder else rng.choice(("none", "selective", "full")),
        "zero": lambda: rng.choice((0, 1, 2, 3)),
        "micro_batch": lambda: rng.choice((1, 2)),
        "offload": lambda: rng.random() < 0.5,
        "schedule": lambda: rng.choice(SCHEDULES),
    }
    if not encoder_decoder:  # compiled encoder-decoders are refused by rule (costmodel.plan_rules)
        options["compile"] = lambda: True
    if encoder_decoder:
        # they run data-parallel only (costmodel.plan_rules.ENCODER_DECODER_SPLITS): drawing their tp, pp or
        # cp would only test the refusal
        degree_values |= {"tp": [], "pp": [], "cp": []}
    options |= {name: values for name, values in degree_values.items() if values}
    if degree_values["pp"] and 2 * min(degree_values["pp"]) <= layers:
        options["virtual_stages"] = lambda: 2
    names = sorted(n for n in options if n in allowed)
    chosen = [focus] if focus in names else []
    for name in rng.sample(names, k=len(names)):
        if len(chosen) >= len(chosen[:1]) + rng.choice((0, 1, 1, 2, 3)):
            break
        if name not in chosen:
            chosen.append(name)
    pins: dict[str, Any] = {}
    used = 1  # product of the pinned degrees, which must divide the world
    for name in chosen:
        if name in DEGREES:
            fitting = [v for v in options[name] if (world // used) % v == 0]
            if fitting:
                pins[name] = rng.choice(fitting)
                used *= pins[name]
        else:
            pins[name] = options[name]()
    if pins.get("compile") and "pp" in degree_values and degree_values["pp"] and rng.random() < 0.5:
        # compiled blocks under a schedule that splits the backward (issue 26's crash)
        pins["schedule"] = rng.choice(SPLIT_BACKWARD)
    if ("virtual_stages" in pins or pins.get("schedule") in (*SPLIT_BACKWARD, "Interleaved1F1B", "LoopedBFS")) \
            and "pp" not in pins and degree_values["pp"]:
        fitting = [v for v in degree_values["pp"] if (world // used) % v == 0]
        if fitting:
            pins["pp"] = min(fitting)  # a schedule or virtual stages ask for a pipeline
        else:
            pins.pop("virtual_stages", None)  # the other degrees left no room for one
    pins.setdefault("precision", "fp32" if rng.random() < 0.7 else "bf16")
    if pins["precision"] == "fp32" and "optimizer" in allowed:
        pins["optimizer"] = "sgd"  # compared with one rank: SGD keeps a gradient's scale and its rounding (COMPARE_LR)
    if focus == "peft" or rng.random() < PEFT_SHARE:
        pins["peft"] = rng.choice(PEFT_METHODS)  # not a planner pin: plan_case hands it to `peft=`
    return pins


def sample_cases(seed: int, count: int, *, allow_compile: bool = True) -> list[Case]:
    """`count` cases from `seed`: the families in turn, the FOCUS pins in turn, the rest at random; a
    multi-rank case also draws the node size (`--gpus-per-node` 1 or 2 makes small "nodes", so TP and
    other groups span them)."""
    from planner.api import PIN_NAMES

    rng = random.Random(seed)
    allowed = frozenset(PIN_NAMES) - (set() if allow_compile else {"compile"})
    cases = []
    for i in range(count):
        focus = FOCUS[i % len(FOCUS)]
        family = "mixtral" if focus == "ep" else FAMILIES[i % len(FAMILIES)]  # experts to spread
        if focus == "compile" and family == "t5":
            family = "llama"
        world = rng.choice((2, 3, 4, 4) if focus not in ("zero", "offload", "recompute") else (1, 2, 3, 4))
        config = random_config(rng, family)
        seq = rng.choice((16, 32))
        pins = random_pins(rng, world, config, allowed, focus, seq)
        if "compile" not in pins and (not allow_compile or rng.random() < 0.75):
            # compile not drawn: mostly pinned off (compiling a plan takes ~10 s on 2 cores), else left to
            # the search, which turns it on where the device's compile factors pay
            pins["compile"] = False
        node = rng.choice((None, None, 1, 2)) if world > 1 else None
        batch = world * rng.choice((2, 4))  # a batch the world divides: refusals then come from the pins
        tag = ",".join(f"{k}={v}" for k, v in sorted(pins.items())) + (f",gpn={node}" if node else "")
        cases.append(Case(name=f"{i:03d}-{family}-w{world}-{tag}", family=family, config=config, world=world,
                          pins=pins, global_batch=batch, seq_len=seq, gpus_per_node=node))
    return cases


def plan_case(case: Case, workdir: Path) -> None:
    """`soap plan` the case (and its 1-rank fp32 reference); sets `case.plan` or a `refused:` outcome."""
    from planner.api import PIN_NAMES, plan_report
    from tracer.errors import SoapError

    config = workdir / f"{case.name.split('-w')[0]}.json"
    config.write_text(json.dumps(case.config))
    # local-cpu has no fp8 rate: an fp8 case is planned for H100s and trains on the CPU ranks, where torchao
    # emulates its float8 Linears (executor.precision)
    cluster = "dgx-h100" if case.pins.get("precision") == "fp8" else "local-cpu"
    pins = {k: v for k, v in case.pins.items() if k != "peft"}
    common = dict(cluster=cluster, global_batch=case.global_batch, seq_len=case.seq_len, peft=case.pins.get("peft"))
    try:
        plan = plan_report(str(config), gpus=case.world, gpus_per_node=case.gpus_per_node, **common, **pins).plan
    except SoapError as exc:
        case.outcome = f"refused: {exc}"
        return
    case.plan = json.loads(plan.to_json())
    if plan.parallelism.precision == "fp32":
        eager = {"compile": False} if "compile" in PIN_NAMES else {}
        reference = plan_report(str(config), gpus=1, **common, precision="fp32",
                                optimizer=plan.parallelism.optimizer, **eager).plan
        case.reference = json.loads(reference.to_json())


def _worker(rank: int, world: int, store: str, plans: list[dict[str, Any]], out: str) -> None:
    """One rank: load each plan as `soap execute` does, check it, train STEPS steps; each rank writes its losses
    or errors (`merged` keeps rank 0's losses, or the failing rank's own error)."""
    import datetime

    import torch
    import torch.distributed as dist

    from executor.launch import check_plan_rules
    from executor.train import RunConfig, train
    from planner.plan import plan_from_dict

    os.environ["LOCAL_RANK"] = str(rank)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # one thread per rank, as soap's launcher gives several ranks on a host: the forkserver's torch read
    # OMP_NUM_THREADS when the server started (its environment then, which may have had none)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))
    results: dict[str, Any] = {}
    for item in plans:
        try:
            plan = plan_from_dict(item["plan"])
            check_plan_rules(plan)
            lr = (PEFT_COMPARE_LR if plan.model.peft else COMPARE_LR).get(plan.parallelism.optimizer, 1e-3)
            results[item["key"]] = train(plan, RunConfig(steps=STEPS, progress=False, lr=lr)).losses
        except Exception as exc:  # noqa: BLE001 - reported per case to the parent
            results[item["key"]] = f"{type(exc).__name__}: {exc} | {traceback.format_exc()[-600:]}"
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    dist.destroy_process_group()


PEER_ERRORS = ("Timed out waiting", "Connection closed by peer", "Application timeout caused pair closure")
"""gloo's words for a rank that waited on a peer which had failed: the peer's own error says what went wrong."""


def merged(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """{key: rank 0's losses, or the error of a rank that did not just wait on a failed peer}."""
    out = {}
    for key, first in per_rank[0].items():
        errors = [r[key] for r in per_rank if not isinstance(r.get(key), list)]
        own = [e for e in errors if not any(word in str(e) for word in PEER_ERRORS)]
        out[key] = first if not errors else (own or errors)[0]
    return out


def execute(plans_by_world: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Train every plan on its world size, one process group per world size; {key: losses or error}."""
    import multiprocessing

    import torch.multiprocessing as mp

    # ranks fork from a server that imported torch, transformers' models and the executor once
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["executor.train", *(f"transformers.models.{f}.modeling_{f}" for f in FAMILIES)])
    results: dict[str, Any] = {}
    for world, plans in sorted(plans_by_world.items()):
        out, store = tempfile.mktemp(prefix="soap-plans-out-"), tempfile.mktemp(prefix="soap-plans-store-")
        try:
            mp.start_processes(_worker, args=(world, store, plans, out), nprocs=world, start_method="forkserver")
            results |= merged([json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world)])
        except Exception as exc:  # noqa: BLE001 - a crashed group fails every plan in it
            results |= {p["key"]: f"process group of {world} crashed: {exc}" for p in plans}
    return results


def run(cases: list[Case]) -> list[Case]:
    """Plan, execute and judge every case (see the module docstring)."""
    workdir = Path(tempfile.mkdtemp(prefix="soap-plans-"))
    for case in cases:
        try:
            plan_case(case, workdir)
        except Exception as exc:  # noqa: BLE001 - a crash while planning is a failure, not a refusal
            case.outcome = f"failed: planning raised {type(exc).__name__}: {exc}"
    by_world: dict[int, list[dict[str, Any]]] = {}
    for case in cases:
        if case.plan is not None:
            by_world.setdefault(case.world, []).append({"key": case.name, "plan": case.plan})
            if case.reference is not None:
                by_world.setdefault(1, []).append({"key": f"{case.name}/reference", "plan": case.reference})
    results = execute(by_world)
    for case in cases:
        if case.plan is None:
            continue
        got = results.get(case.name, "no result")
        if not isinstance(got, list):
            case.outcome = f"failed: {got}"
            continue
        case.losses = got
        if not all(math.isfinite(x) for x in got):
            case.outcome = f"failed: losses {got}"
            continue
        case.outcome = "ran"
        if case.reference is not None:
            ref = results.get(f"{case.name}/reference")
            if not isinstance(ref, list):
                case.outcome = f"failed: the 1-rank reference did not run: {ref}"
            elif any(abs(a - b) > REL * abs(b) for a, b in zip(got, ref)):
                case.outcome = f"mismatch: {got} vs the 1-rank plan's {ref}"
    return cases


def summary(case: Case) -> str:
    """`pp2 dp1 ...` of the planned layout, from plan.json."""
    if case.plan is None:
        return "-"
    p = case.plan["parallelism"]
    parts = [f"{k}{p[k]}" for k in ("pp", "dp", "cp", "tp", "ep") if p.get(k, 1) > 1]
    parts += [f"zero{p['zero']}", f"mb{p['micro_batch']}x{p['num_microbatches']}", p["precision"]]
    if p["pp"] > 1:
        parts.append(p["schedule"] + (f"(v{p['virtual_stages']})" if p["virtual_stages"] > 1 else ""))
    if p.get("recompute", "none") != "none":
        parts.append(p["recompute"])
    if p.get("compile"):
        parts.append("compile")
    if p.get("offload_optimizer"):
        parts.append("offload")
    if (case.plan.get("model") or {}).get("peft"):
        parts.append(case.plan["model"]["peft"]["method"])
    return " ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-compile", action="store_true", help="never draw the compile pin (faster on CPU)")
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args()
    begin = time.perf_counter()
    cases = run(sample_cases(args.seed, args.cases, allow_compile=not args.no_compile))
    seconds = time.perf_counter() - begin
    rows = [f"| {c.family} | {c.world} | {', '.join(f'{k}={v}' for k, v in sorted(c.pins.items()))} | {summary(c)} | "
            f"{c.outcome.split(':')[0]} |" for c in cases]
    counts = {k: sum(c.outcome.startswith(k) for c in cases) for k in ("ran", "refused", "failed", "mismatch")}
    for c in cases:
        print(f"{c.name:60s} {summary(c):40s} {c.outcome[:200]}")
    print(f"{counts} in {seconds:.0f} s")
    if args.no_docs:
        return
    from benchmarks.report import update_section

    text = "\n".join([
        f"`python -m benchmarks.plans_execute --cases {args.cases} --seed {args.seed}` on this 2-core CPU machine "
        f"(gloo ranks; {seconds:.0f} s): random tiny models and pins, `soap plan` on `local-cpu`, plan.json, "
        f"{STEPS} training steps on the plan's ranks; fp32 plans must equal the same model's 1-rank plan "
        f"(relative {REL}). Refused = the planner's one `error:` line for pins no plan meets.",
        "",
        f"ran {counts['ran']}, refused {counts['refused']}, failed {counts['failed']}, "
        f"mismatched {counts['mismatch']}.",
        "",
        "| family | ranks | pins | plan | outcome |",
        "|---|---|---|---|---|",
        *rows,
    ])
    update_section("plans-execute", "Every plan soap writes executes (random models and pins)", text)


if __name__ == "__main__":
    main()
