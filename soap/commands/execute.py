"""`soap execute PLAN`: train with a plan on torch.distributed (one node or many, like torchrun).

    soap execute plan.json --steps 20                    # launches the plan's world size locally
    soap execute plan.json --nnodes 2 --node-rank 0 --rdzv-endpoint host:29400 --rdzv-backend c10d
    torchrun --nproc-per-node 4 -m soap execute plan.json # under an external torchrun: one rank each
    soap execute plan.json --checkpoint-dir ckpt --checkpoint-every 5 [--resume]
    soap execute plan.json --elastic --nnodes 3:4 --rdzv-backend c10d --rdzv-endpoint host:29400 --rdzv-id job1 \
        --max-restarts 3 --checkpoint-dir ckpt --checkpoint-every 5  # a node lost or joined: re-plan for the new
                                                                      # world (soap.elastic) and resume
    soap execute plan.json --dataset corpus.jsonl --tokenizer tok/  # tokenized, packed and cached once
    soap execute plan.json --save-hf trained/           # then AutoModelForCausalLM.from_pretrained("trained/")
    soap execute plan.json --timeout 120                 # end a stuck run after 2 minutes without progress
    soap execute plan.json --memory-snapshot snap/       # CUDA allocator history of one step: snap/rank0.pickle

Progress and the measured-vs-predicted summary go to stderr; the run report is written as JSON
(`--report`, default `<plan>.run.json`); `--json` prints one object on stdout: losses, step_time_s,
predicted_step_time_s, peak_memory_gib, parallelism (and more).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from tracer.errors import SoapError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("execute", help="train with a plan on torch.distributed",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", help="plan.json written by `soap plan`")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and synthetic data")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--data", default=None, help="token ids: a .npy, or a .bin of uint16 (default: synthetic)")
    p.add_argument("--dataset", default=None, metavar="PATH",
                   help="train on a `datasets` dataset saved to disk, or local json/jsonl/parquet/text files (a file "
                        "or a directory), tokenized with --tokenizer and packed to the plan's seq_len (cached); "
                        "needs the `datasets` package: `pip install -e '.[data]'` in the soap checkout")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="a local tokenizer directory, for --dataset")
    p.add_argument("--weights", default=None, help="start from a local HF checkpoint directory (safetensors)")
    p.add_argument("--checkpoint-dir", default=None, help="save DCP checkpoints here")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (default: at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--save-hf", default=None, metavar="DIR",
                   help="after the last step, write the trained model to DIR as a transformers-loadable directory "
                        "(config.json + model.safetensors); `soap export-hf` converts a DCP checkpoint the same way")
    p.add_argument("--merge", action="store_true",
                   help="with --save-hf and a --peft plan: also write the model with its adapters merged (DIR/merged)")
    p.add_argument("--report", default=None, help="run-report JSON path (default <plan>.run.json)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="end the run when a rank makes no progress for this long inside a step, naming what "
                        "it waited on (default: 20x the plan's predicted step time, at least 60 s; the setup "
                        "and the first step get at least 300 s)")
    p.add_argument("--memory-snapshot", default=None, metavar="DIR",
                   help="CUDA: record the caching allocator's history over one steady step (the second) and write "
                        "DIR/rank{R}.pickle, drawn by https://pytorch.org/memory_viz (as torchtitan's "
                        "enable_memory_snapshot); a note and nothing written on the CPU")
    add_launch_flags(p)
    return p


def add_launch_flags(p: argparse.ArgumentParser) -> None:
    """torchrun's launch flags, shared by `soap execute` and `soap tune`."""
    t = p.add_argument_group("launch (torchrun's flags)")
    t.add_argument("--nproc-per-node", type=int, default=None, help="workers per node (default: plan ranks / nodes)")
    t.add_argument("--nnodes", default="1", help="N or MIN:MAX (default 1)")
    t.add_argument("--node-rank", type=int, default=0)
    t.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT")
    t.add_argument("--rdzv-backend", default="static", help="static (default) or c10d")
    t.add_argument("--rdzv-id", default=None)
    t.add_argument("--max-restarts", type=int, default=0)
    t.add_argument("--rdzv-conf", default="", metavar="KEY=VALUE,...",
                   help="rendezvous options, as torchrun's (e.g. last_call_timeout=5)")
    t.add_argument("--elastic", action="store_true",
                   help="with --nnodes MIN:MAX and --max-restarts: when nodes leave or join and the workers restart "
                        "in a world of another size, re-plan for it (as `soap replan`) and resume from the newest "
                        "checkpoint (needs --checkpoint-dir); the report lists each re-plan")
    t.add_argument("--master-addr", default="127.0.0.1")
    t.add_argument("--master-port", type=int, default=29500)
    t.add_argument("--allow-cpu", action="store_true",
                   help="run a plan made for GPUs on CPU processes (gloo) when this host has no GPU: a slow smoke "
                        "run; without it such a plan is refused before any worker starts")


def launch_options(args: argparse.Namespace) -> Any:
    from executor.launch import LaunchOptions

    return LaunchOptions(nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank,
                         rdzv_endpoint=args.rdzv_endpoint, rdzv_backend=args.rdzv_backend, rdzv_id=args.rdzv_id,
                         max_restarts=args.max_restarts, rdzv_conf=args.rdzv_conf, master_addr=args.master_addr,
                         master_port=args.master_port, debug=getattr(args, "debug", False),
                         allow_cpu=args.allow_cpu, replan=_elastic_replan(args))


def _elastic_replan(args: argparse.Namespace) -> Any:
    if not getattr(args, "elastic", False):
        return None
    from soap.elastic import replan_for_world

    return replan_for_world


def run(args: argparse.Namespace) -> int:
    from executor.launch import node_counts, preflight, run_plan
    from planner.plan import load_plan
    from tracer.files import write_atomic
    from tracer.files import check_writable, check_writable_dir

    plan = load_plan(args.plan)
    if args.steps < 1:
        raise SoapError(f"--steps {args.steps}: need at least 1 step")
    if args.timeout is not None and not args.timeout > 0:
        raise SoapError(f"--timeout {args.timeout:g}: need a positive number of seconds")
    if args.elastic and not args.checkpoint_dir:
        raise SoapError("--elastic resumes re-planned workers from checkpoints: pass --checkpoint-dir D "
                        "(and --checkpoint-every N)")
    if args.elastic and args.rdzv_id in (None, "none") and node_counts(args.nnodes)[1] > 1:
        raise SoapError("--elastic on several nodes: pass --rdzv-id JOB, the same on every node (a worker group "
                        "re-formed after nodes leave or join resumes the checkpoints its job wrote)")
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        raise SoapError("--resume and --checkpoint-every need --checkpoint-dir D")
    if args.resume:
        from executor.checkpoint import check_resumable

        check_resumable(plan, args.checkpoint_dir)  # another batch would not continue the data order
    if args.dataset and args.data:
        raise SoapError("--dataset and --data both name the training data; pass one")
    if bool(args.dataset) != bool(args.tokenizer):
        raise SoapError("--dataset PATH needs --tokenizer DIR (a local tokenizer), and --tokenizer needs --dataset")
    for path, flag in ((args.data, "--data"), (args.weights, "--weights"), (args.dataset, "--dataset"),
                       (args.tokenizer, "--tokenizer")):
        if path and not os.path.exists(path):
            raise SoapError(f"{flag} {path}: no such file or directory")
    report = Path(args.report) if args.report else Path(args.plan).with_suffix(".run.json")
    check_writable(report, what="--report")
    if args.checkpoint_dir:
        check_writable_dir(args.checkpoint_dir, what="--checkpoint-dir")
    if args.save_hf:
        check_writable_dir(args.save_hf, what="--save-hf")
    if args.memory_snapshot:
        check_writable_dir(args.memory_snapshot, what="--memory-snapshot")
    if args.merge and (not args.save_hf or plan.model.peft is None):
        raise SoapError("--merge folds a PEFT plan's adapters into its base when saving: it needs --save-hf DIR "
                        "and a plan made with --peft")
    if plan.model.peft is not None and plan.model.peft.method == "qlora":
        from importlib.util import find_spec

        if find_spec("bitsandbytes") is None:
            raise SoapError("this QLoRA plan needs bitsandbytes, which is not installed here; "
                            "pip install 'soap[peft]' (its CPU backend runs 4-bit weights too)")
    launch = launch_options(args)
    preflight(plan, launch)  # before anything slow: the plan against this host and the launch flags
    from executor.train import RunConfig  # imports the executor (torch.distributed, dynamo): seconds
    data = args.data
    if args.dataset:
        from executor.data import prepare_dataset

        from types import SimpleNamespace

        from tracer.api import model_dims

        vocab = model_dims(SimpleNamespace(**plan.model.config), []).vocab or None
        data = str(prepare_dataset(args.dataset, args.tokenizer, plan.seq_len, vocab_size=vocab))
    config = RunConfig(steps=args.steps, seed=args.seed, lr=args.lr, data=data, weights=args.weights,
                       checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                       resume=args.resume, save_hf=args.save_hf, merge=args.merge, progress=True,
                       memory_snapshot=args.memory_snapshot, timeout_s=args.timeout)
    result = run_plan(plan, config, launch)
    if result is None:  # not global rank 0
        return 0
    write_atomic(report, json.dumps(result, indent=2, sort_keys=True) + "\n", what="--report")
    # Every run feeds `soap calibrate --from-runs`.
    from executor.runs_log import append_run

    append_run(result, plan=plan, name=Path(args.plan).stem)
    if args.save_hf:
        _finish_save_hf(args.save_hf, args.tokenizer, peft=plan.model.peft is not None, merged=args.merge)
    _summary(result, report)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0


def _finish_save_hf(directory: str, tokenizer: str | None, *, peft: bool = False, merged: bool = False) -> None:
    """Put the tokenizer the run trained with beside the model, and say what was written."""
    files = ("adapter_config.json, adapter_model.safetensors, base/" + (", merged/" if merged else "") if peft
             else "config.json, model.safetensors")
    if tokenizer:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer, local_files_only=True).save_pretrained(directory)
        files += f" and the tokenizer from {tokenizer}"
    else:
        files += " (no tokenizer: the run had no --tokenizer)"
    print(f"wrote {directory}: {files}", file=sys.stderr)


def _summary(result: dict, report: Path) -> None:
    def fmt(value: float | None, unit: str) -> str:
        return "n/a" if value is None else f"{value:.4g} {unit}"

    lines = [
        f"final loss {result['losses'][-1]:.4f} after {len(result['losses'])} steps",
        f"step time  measured {fmt(result['step_time_s'], 's')} (median)   predicted {fmt(result['predicted_step_time_s'], 's')}",
        f"memory     measured {fmt(result['peak_memory_gib'], 'GiB')} ({result['peak_memory_source']}, max over ranks)"
        f"   predicted {fmt(result['predicted_peak_memory_gib'], 'GiB')}",
        f"tokens/s   {result['tokens_per_s']:.4g}",
        f"report     {report}",
    ]
    print("\n".join(lines), file=sys.stderr)
