"""`soap export-hf CHECKPOINT --plan PLAN -o DIR`: a DCP checkpoint of `soap execute` as an HF model directory.

    soap execute plan.json --checkpoint-dir ckpt          # trains and saves DCP checkpoints
    soap export-hf ckpt --plan plan.json -o trained/      # the newest one (or name a ckpt/step-N directory)
    python -c 'from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained("trained/")'

CHECKPOINT is a `--checkpoint-dir` (its `latest` checkpoint is taken) or one `step-N` directory in it;
PLAN the plan it was trained with (the model's config and the layout soap normalized it to). The
directory written (config.json + model.safetensors) is the one `soap execute --save-hf` writes; it runs in
one process, whatever layout saved the checkpoint (`executor.hf_export.export_dcp_checkpoint`).
"""

from __future__ import annotations

import argparse
import os
import sys

from tracer.errors import SoapError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export-hf", help="convert a DCP checkpoint of `soap execute` into an HF model directory",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a --checkpoint-dir, or one step-N directory in it")
    p.add_argument("--plan", required=True, help="the plan.json the checkpoint was trained with")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="HF directory to write")
    return p


def run(args: argparse.Namespace) -> int:
    from executor.hf_export import export_dcp_checkpoint
    from planner.plan import load_plan
    from tracer.files import check_writable_dir

    if not os.path.isdir(args.checkpoint):
        raise SoapError(f"{args.checkpoint}: no such directory; pass a --checkpoint-dir written by `soap execute`")
    plan = load_plan(args.plan)
    check_writable_dir(args.output, what="-o")
    written = export_dcp_checkpoint(args.checkpoint, plan, args.output)
    print(f"wrote {written}/config.json and model.safetensors", file=sys.stderr)
    return 0
