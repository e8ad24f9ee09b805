"""The CPU example of docs/tuning.md: `soap tune` on 4 gloo ranks with a deliberately wrong profile.

    flock -x /tmp/soap-cpu.lock python -m benchmarks.tune_cpu [--steps 3] [--top 3] [--dry-run]

A tiny Llama (hidden 64, 4 layers, vocabulary 2048, sequence 32, global batch 8) is tuned on 4 ranks of
`local-cpu` with every link's bandwidth misstated 10x too low (`misstated_cluster`): communication looks
expensive, so the search puts a pipeline first. The tune tries the 3 best plans that differ in mesh or
schedule (compile pinned off), refits the profile from them, re-plans, and keeps the measured fastest. Writes
the trial table between the markers of docs/tuning.md, naming the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DOC = Path(__file__).resolve().parents[1] / "docs" / "tuning.md"
TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=2048, max_position_embeddings=64,
                  tie_word_embeddings=False)
BANDWIDTH_FACTOR = 0.1
"""Every link's bandwidth in the wrong profile, as a share of local-cpu's."""


def write_model(directory: Path, **overrides: Any) -> Path:
    """A config.json of the tiny Llama in `directory`."""
    from transformers import AutoConfig

    fields = {**TINY_LLAMA, **overrides}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
    return directory


def misstated_cluster(path: Path, factor: float = BANDWIDTH_FACTOR, base: str = "local-cpu") -> Path:
    """`base`'s profile with every link's bandwidth multiplied by `factor` (on purpose, the source says so)."""
    from costmodel.profiles import cluster_to_dict, load_cluster

    data = cluster_to_dict(load_cluster(base))
    for link in data["links"].values():
        link["bandwidth_gbps"]["value"] *= factor
        link["bandwidth_gbps"]["source"] += f"; misstated x{factor:g} on purpose (benchmarks/tune_cpu.py)"
    data["name"] = f"{base}-wrong"
    path.write_text(json.dumps(data, indent=1))
    return path


def tune_args(model: Path, cluster: Path, directory: Path, *, top: int, steps: int) -> list[str]:
    return [str(model), "--gpus", "4", "--cluster", str(cluster), "--seq-len", "32", "--global-batch", "8",
            "--no-compile", "--top", str(top), "--steps", str(steps), "--warmup", "1", "--dir", str(directory)]


def table(report: dict[str, Any]) -> str:
    lines = ["| plan | round | status | predicted s | measured s | measured GiB/rank | rank |",
             "|---|---|---|---:|---:|---:|---:|"]
    for t in report["trials"]:
        def f(v: Any) -> str:
            return "-" if v is None else f"{v:.4f}"
        first = " (first predicted)" if t["id"] == report["first_predicted"] else ""
        lines.append(f"| {t['plan']}{first} | {t['round']} | {t['status']} | {f(t['predicted_step_time_s'])} | "
                     f"{f(t['measured_step_time_s'])} | {f(t['measured_peak_memory_gib'])} | {t['rank'] or '-'} |")
    refit = report["refit"]
    lines += ["", f"Measured best: **{report['best_plan']}** ({report['measured_step_time_s']:.4f} s/step; "
              f"{'the' if report['best_is_first_predicted'] else 'not the'} plan first predicted). "
              f"Re-planned on the refitted profile: {report['replanned']['plan'] or 'none'}. "
              f"Step-time error of the profile on the {refit['trials']} trials (geometric mean error factor): "
              f"{refit['log_error_before_pct']:.1f}% before the refit, {refit['log_error_after_pct']:.1f}% after; "
              f"MAPE {refit['mape_before_pct']:.1f}% before, {refit['mape_after_pct']:.1f}% after "
              f"(multipliers: " + ", ".join(f"{k} x{v:.3g}" for k, v in refit["multipliers"].items()) + ")."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="print the table, leave docs/tuning.md alone")
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from benchmarks.report import git_revision, machine_description
    from soap.cli import main as soap_main

    work = Path(tempfile.mkdtemp(prefix="soap-tune-cpu-"))
    model = write_model(work / "model")
    cluster = misstated_cluster(work / "cluster.json")
    out = work / "report.json"
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = soap_main(["tune", *tune_args(model, cluster, work / "tune", top=args.top, steps=args.steps),
                          "-o", str(work / "plan.json"), "--json"])
    if code:
        raise SystemExit(code)
    report = json.loads(buffer.getvalue().strip().splitlines()[-1])
    out.write_text(json.dumps(report, indent=2))
    body = (f"_Measured by `python -m benchmarks.tune_cpu` (commit {git_revision()}) on: {machine_description()}; "
            f"{args.steps} timed steps after 1 warm-up step per trial; every link's bandwidth in the profile "
            f"misstated x{BANDWIDTH_FACTOR:g}._\n\n{table(report)}\n")
    print(body)
    if args.dry_run:
        return
    text = DOC.read_text()
    pattern = re.compile(r"<!-- BEGIN tune_cpu -->.*?<!-- END tune_cpu -->", re.S)
    DOC.write_text(pattern.sub(lambda _: f"<!-- BEGIN tune_cpu -->\n{body}<!-- END tune_cpu -->", text))


if __name__ == "__main__":
    main()
