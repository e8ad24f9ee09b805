"""Plan speed: wall time of `soap plan` as a subprocess, tracing included, on this machine.

Headline cases against the targets (gpt2 on 8 GPUs <= 3 s, llama-3-70b on 1,024 <= 15 s,
llama-3.1-405b on 16,384 <= 60 s), then how the time grows with the GPU count (llama-3-8b) and with the
layer count (llama-3-8b's config with 8 ... 128 layers, 512 GPUs). Each case also times
`soap trace` alone, so the search's share is visible. Run it on a quiet machine:

    flock -x /tmp/soap-cpu.lock python -m benchmarks.plan_speed
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.report import update_section

ROOT = Path(__file__).resolve().parents[1]
HEADLINE = (("gpt2", 8, 3.0), ("llama-3-70b", 1024, 15.0), ("llama-3.1-405b", 16384, 60.0))
GPU_GROWTH = (8, 64, 512, 4096, 16384)
LAYER_GROWTH = (8, 16, 32, 64, 128)


def _wall(args: list[str]) -> tuple[float, dict]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "soap", *args, "--json"], cwd=ROOT, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"soap {' '.join(args)} failed: {done.stderr.strip().splitlines()[-1]}")
    return elapsed, json.loads(done.stdout)


def _case(model: str, gpus: int) -> tuple[float, float, dict]:
    total, out = _wall(["plan", model, "--gpus", str(gpus)])
    trace, _ = _wall(["trace", model, "--seq-len", str(out["plan"] and _seq_len(out))])
    return total, trace, out


def _seq_len(out: dict) -> int:
    return int(round(out["tokens_per_s"] / out["samples_per_s"]))


def _row(label: str, gpus: int, total: float, trace: float, out: dict, target: float | None = None) -> str:
    verdict = "" if target is None else (f"{target:.0f} s: {'met' if total <= target else 'missed'}")
    return (f"| {label} | {gpus:,} | {total:.1f} | {trace:.1f} | {total - trace:.1f} | {out['candidates_estimated']:,} | "
            f"{out['candidates_simulated']} | {out['plan']} | {verdict} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    header = ("| case | GPUs | soap plan (s) | soap trace alone (s) | difference (s) | configurations estimated | "
              "simulated | chosen plan | target |\n|" + "---|" * 9)
    sections = []
    rows = []
    for model, gpus, target in HEADLINE:
        total, trace, out = _case(model, gpus)
        rows.append(_row(model, gpus, total, trace, out, target))
        print(rows[-1], file=sys.stderr)
    sections.append("Headline cases:\n\n" + header + "\n" + "\n".join(rows))
    rows = []
    for gpus in GPU_GROWTH:
        total, trace, out = _case("llama-3-8b", gpus)
        rows.append(_row("llama-3-8b", gpus, total, trace, out))
        print(rows[-1], file=sys.stderr)
    sections.append("Growth with GPU count (llama-3-8b):\n\n" + header + "\n" + "\n".join(rows))
    rows = []
    preset = json.loads((ROOT / "tracer" / "presets" / "llama-3-8b.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        for layers in LAYER_GROWTH:
            model = Path(tmp) / f"llama-3-8b-{layers}-layers"
            model.mkdir()
            (model / "config.json").write_text(json.dumps({**preset, "num_hidden_layers": layers}))
            total, trace, out = _case(str(model), 512)
            rows.append(_row(f"llama-3-8b, {layers} layers", 512, total, trace, out))
            print(rows[-1], file=sys.stderr)
    sections.append("Growth with layer count (llama-3-8b config, 512 GPUs):\n\n" + header + "\n" + "\n".join(rows))
    body = ("Wall time of `soap plan MODEL --gpus N --json` as a fresh subprocess (Python start-up, imports and "
            "tracing included), and of `soap trace MODEL --json` alone for comparison; the difference is "
            "roughly the search (enumeration, estimates, simulations, plan building).\n\n" + "\n\n".join(sections))
    if args.no_write:
        print(body)
    else:
        update_section("plan-speed", "Plan speed: wall time of soap plan", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
