"""Write a benchmark's results into its own section of docs/benchmarks.md.

Each benchmark owns one section, delimited by `<!-- BEGIN name -->` / `<!-- END name -->`. Updating is a
locked read-modify-write followed by an atomic rename, so benchmarks run side by side don't lose each
other's sections.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import os
import platform
import re
import subprocess
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEvery figure here was written by a script in `benchmarks/`; each section names its machine.\n"


def machine_description() -> str:
    """One line naming the machine the numbers were measured on."""
    from costmodel.calibration.calibrate import machine_name

    cpu = machine_name("cpu")
    try:
        import torch

        if torch.cuda.is_available():
            cpu += f", GPU {torch.cuda.get_device_name(0)}"
        torch_v = torch.__version__
    except ImportError:
        torch_v = "n/a"
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}; {os.cpu_count()} cores; {mem_gib:.0f} GiB RAM; torch {torch_v}; Python {platform.python_version()}"


def git_revision() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, cwd=DOC.parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def update_section(name: str, title: str, body: str, *, machine: str | None = None) -> None:
    """Replace (or append) section `name` of docs/benchmarks.md with `body` under `title`; `machine` names
    where it was measured when that is not this machine (a run on a GPU machine, recorded here)."""
    stamp = f"_Measured {_dt.date.today().isoformat()} at commit {git_revision()} on: {machine or machine_description()}._"
    section = f"<!-- BEGIN {name} -->\n## {title}\n\n{stamp}\n\n{body.rstrip()}\n<!-- END {name} -->\n"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    with open(DOC.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        text = DOC.read_text() if DOC.exists() else HEADER
        pattern = re.compile(rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->\n?", re.S)
        text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section
        tmp = DOC.with_suffix(".md.tmp")
        tmp.write_text(text)
        os.replace(tmp, DOC)


def emit(result: dict, table: str, out: str | None) -> dict:
    """Print a measurement script's table and, where asked, keep its measurements as JSON (the GPU scripts' output
    comes back from a lent machine as files)."""
    import json

    print(table)
    if out:
        Path(out).write_text(json.dumps(result, indent=1))
    return result
