"""`soap replan` for the docs: a `llama-3-8b` plan on 8 `dgx-h100` GPUs re-planned for 6 and for 16 GPUs.

The 8-GPU plan uses the default global batch (1024 sequences of 4096 tokens, 2^22 tokens). 1024 is not a
multiple of 6, but the run needs only a data-parallel degree that divides it, and on 6 GPUs the search finds
one (dp2 x pp3), so the batch is kept and a checkpoint of the 8-GPU run resumes on 6 GPUs on the same data
order. The section also shows the refusal of a batch change without `--allow-batch-change` and the
stated learning-rate rule with it. Each command is a subprocess; its output is copied verbatim.

    python -m benchmarks.replan_llama
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.report import update_section

ROOT = Path(__file__).resolve().parents[1]


def soap(*args: str) -> tuple[str, int]:
    proc = subprocess.run([sys.executable, "-m", "soap", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    return (proc.stdout + proc.stderr).rstrip(), proc.returncode


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        plan8 = f"{tmp}/plan8.json"
        _, code = soap("plan", "llama-3-8b", "--gpus", "8", "-o", plan8)
        assert code == 0
        runs = [("replan", plan8, "--gpus", "6", "-o", f"{tmp}/plan6.json"),
                ("replan", plan8, "--gpus", "16", "-o", f"{tmp}/plan16.json"),
                ("replan", plan8, "--gpus", "6", "--global-batch", "1020"),
                ("replan", plan8, "--gpus", "6", "--global-batch", "1020", "--allow-batch-change")]
        parts = ["`soap plan llama-3-8b --gpus 8 -o plan8.json` (default global batch 1024 x 4096), then:\n"]
        for args in runs:
            text, code = soap(*args)
            shown = " ".join(a.replace(tmp + "/", "") for a in args)
            parts.append(f"```\n$ soap {shown}\n{text.replace(tmp + '/', '')}\n(exit {code})\n```\n")
    body = "\n".join(parts) + (
        "\nThe batch is kept on 6 GPUs: 1024 does not divide by 6, but only the data-parallel degree must divide it "
        "(dp2 x pp3 here). A different batch is refused unless `--allow-batch-change` is given, and then the "
        "learning-rate rule is stated.\n")
    update_section("replan-llama-3-8b", "soap replan: llama-3-8b from 8 to 6 and 16 dgx-h100 GPUs", body)


if __name__ == "__main__":
    main()
