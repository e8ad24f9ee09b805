"""How fast, and how cheaply, `soap execute` refuses a plan this host cannot run (issue 26, item 5).

    python -m benchmarks.execute_preflight

Plans the README's job (llama-3-8b on one 8-GPU H100 node) and a 1,024-GPU llama-3-70b job, then runs
`soap execute` on each as a new user on a machine without a GPU would: plain, and with `--allow-cpu`.
Each run must end in one `error:` line (exit 2) before any worker starts (`executor/preflight.py`); the
script records the wall time of the whole command (interpreter start and imports included) and the
command's peak resident memory, and writes section `execute-preflight` of docs/benchmarks.md.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = (
    ("README plan (8 x dgx-h100), no GPU here", "readme", ()),
    ("README plan, --allow-cpu (8 ranks x the plan's memory)", "readme", ("--allow-cpu",)),
    ("1,024-GPU plan, no GPU here", "1024", ()),
    ("1,024-GPU plan, --allow-cpu, one node", "1024", ("--allow-cpu",)),
)


def run_case(plan: Path, flags: tuple[str, ...]) -> tuple[float, float, int, str]:
    """(wall seconds, peak RSS GiB, exit code, the last stderr line) of `soap execute PLAN FLAGS`."""
    begin = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "soap", "execute", str(plan), "--steps", "2", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read().strip().splitlines()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - begin
    return seconds, usage.ru_maxrss * 1024 / 2**30, os.waitstatus_to_exitcode(status), stderr[-1] if stderr else ""


def main() -> None:
    import soap

    out = Path(tempfile.mkdtemp(prefix="soap-preflight-"))
    plans = {"readme": out / "readme.json", "1024": out / "1024.json"}
    soap.plan("llama-3-8b", gpus=8).save(str(plans["readme"]))
    soap.plan("llama-3-70b", gpus=1024).save(str(plans["1024"]))
    rows = []
    for title, key, flags in CASES:
        seconds, rss, code, line = run_case(plans[key], flags)
        print(f"{title}: {seconds:.2f} s, {rss:.2f} GiB, exit {code}: {line}")
        rows.append(f"| {title} | {seconds:.1f} | {rss:.2f} | {code} | {line.replace('|', '/')} |")
    load = os.getloadavg()[0]
    from benchmarks.report import update_section

    update_section("execute-preflight", "soap execute refuses what this host cannot run", "\n".join([
        "`python -m benchmarks.execute_preflight`: `soap execute` of plans made for other machines, on this "
        f"machine without a GPU (load average {load:.1f} when measured). Wall time of the whole command "
        "(interpreter start, imports, plan loading); peak RSS of the command; no worker process is started.",
        "",
        "| case | wall s | peak RSS GiB | exit | stderr |",
        "|---|---:|---:|---:|---|",
        *rows,
    ]))


if __name__ == "__main__":
    main()
