"""Starting the ranks on a CPU host: spawned against forked from the launcher's forkserver.

`executor.launch` starts CPU ranks from a forkserver that imported the executor and the plan's model code
once (`start_method`); a CUDA host spawns them, as torchrun does, and each spawned rank imports torch,
transformers and the executor itself. This times both on this machine: one fresh process per start method
and world size (as a `soap execute` or `soap tune` process is) runs `executor.launch.run_plan` three times
in a row on the same plan (a tiny Llama, DDP over 2 or 4 gloo ranks, 1 training step), and the table
gives each launch's wall time, from the call to rank 0's result. The first launch pays for the
forkserver's own imports; the later ones (a tune's further trials) reuse it.

    python -m benchmarks.launch_startup [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHES = 3
WORLDS = (2, 4)
METHODS = ("spawn", "forkserver")


def time_launches(method: str, world: int) -> list[float]:
    """In this process: `LAUNCHES` launches of the same plan with ranks started by `method`."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from exec_helpers import make_plan

    import executor.launch as launch
    from executor.train import RunConfig

    chosen = launch.start_method

    def forced(plan):
        chosen(plan)  # the forkserver's preload list, as the launcher sets it
        return method

    launch.start_method = forced
    plan = make_plan("llama", dp_replicate=world, micro_batch=2)
    seconds = []
    for _ in range(LAUNCHES):
        begin = time.perf_counter()
        result = launch.run_plan(plan, RunConfig(progress=False, steps=1), launch.LaunchOptions())
        seconds.append(time.perf_counter() - begin)
        assert result is not None and len(result["losses"]) == 1, result
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "WORLD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(time_launches(args.one[0], int(args.one[1]))))
        return
    rows = []
    for world in WORLDS:
        for method in METHODS:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.launch_startup", "--one", method, str(world)],
                                  cwd=ROOT, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise SystemExit(f"error: {method} on {world} ranks failed: {proc.stderr[-2000:]}")
            seconds = json.loads(proc.stdout.strip().splitlines()[-1])
            cells = " | ".join(f"{s:.1f}" for s in seconds)
            rows.append(f"| {world} | {method} | {cells} | {sum(seconds):.1f} |")
            print(rows[-1], flush=True)
    text = "\n".join([
        "`python -m benchmarks.launch_startup`: one fresh process per row runs `executor.launch.run_plan` "
        f"{LAUNCHES} times in a row on a tiny Llama (DDP over the row's gloo ranks, 1 step), ranks started "
        "by torch's elastic agent with the row's start method; wall seconds per launch, from the call to rank "
        "0's result. `forkserver` is what the launcher does on a CPU host since 2026-11-29 (the server "
        "imports the executor and the model code once, at the first launch); `spawn` what it did before, and "
        "still does on a CUDA host.",
        "",
        "| ranks | start method | " + " | ".join(f"launch {i + 1} s" for i in range(LAUNCHES)) + " | total s |",
        "|---|---|" + "---|" * (LAUNCHES + 1),
        *rows,
    ])
    if not args.no_docs:
        from benchmarks.report import update_section

        update_section("launch-startup", "Starting the ranks on a CPU host: spawn against the forkserver", text)


if __name__ == "__main__":
    main()
