"""Plan speed: wall time of `soap plan` as a subprocess, tracing included, on this machine.

Headline cases against issue 17's warm targets (gpt2 on 8 GPUs <= 1.5 s, llama-3-8b on 8 <= 3 s,
llama-3-70b on 1,024 <= 5 s, llama-3.1-405b on 16,384 <= 10 s): cold once (an empty trace cache, so the
model is traced and transformers imported), then warm (the tracer's on-disk cache hit) the best of
`WARM_RUNS`, since the machine is shared. A cold run's target is the import floor (a fresh process
importing torch and transformers' llama modeling, best of `WARM_RUNS`, measured in the same run) + 1 s
+ the case's warm time. Then how the warm time grows with
the GPU count (llama-3-8b) and with the layer count (llama-3-8b's config with 8 ... 128 layers on 512
GPUs). Run it on a quiet machine:

    flock -x /tmp/soap-cpu.lock python -m benchmarks.plan_speed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.report import update_section

ROOT = Path(__file__).resolve().parents[1]
HEADLINE = (("gpt2", 8, 1.5), ("llama-3-8b", 8, 3.0), ("llama-3-70b", 1024, 5.0), ("llama-3.1-405b", 16384, 10.0))
WARM_RUNS = 3
GPU_GROWTH = (8, 64, 512, 4096, 16384)
LAYER_GROWTH = (8, 16, 32, 64, 128)
HEADER = ("| case | GPUs | wall time (s) | configurations estimated | simulated | chosen plan |\n"
          "|---|---|---|---|---|---|")


def soap_plan(model: str, gpus: int, cache: str) -> tuple[float, dict]:
    env = {**os.environ, "SOAP_CACHE_DIR": cache}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "soap", "plan", model, "--gpus", str(gpus), "--json"], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"soap plan {model} --gpus {gpus} failed: {done.stderr.strip().splitlines()[-1]}")
    return elapsed, json.loads(done.stdout)


def import_floor() -> float:
    """Wall time of a fresh interpreter importing what a cold trace must: torch and transformers' modeling."""
    code = "import torch, transformers.models.llama.modeling_llama"
    times = []
    for _ in range(WARM_RUNS):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return min(times)


def _row(label: str, gpus: int, seconds: str, out: dict) -> str:
    return f"| {label} | {gpus:,} | {seconds} | {out['candidates_estimated']:,} | {out['candidates_simulated']} | {out['plan']} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    sections = []
    with tempfile.TemporaryDirectory() as tmp:
        floor = import_floor()
        rows = ["| case | GPUs | cold (s) | warm (s) | warm target | cold target | configurations estimated | "
                "simulated | chosen plan |", "|---|---|---|---|---|---|---|---|---|"]
        for model, gpus, target in HEADLINE:
            cold, _ = soap_plan(model, gpus, f"{tmp}/headline-{model}")
            warm, out = min((soap_plan(model, gpus, f"{tmp}/headline-{model}") for _ in range(WARM_RUNS)),
                            key=lambda run: run[0])
            cold_target = floor + 1 + warm
            verdict = f"<= {target:g} s: {'met' if warm <= target else 'missed'}"
            cold_verdict = f"<= {cold_target:.1f} s: {'met' if cold <= cold_target else 'missed'}"
            rows.append(f"| {model} | {gpus:,} | {cold:.1f} | {warm:.2f} | {verdict} | {cold_verdict} | "
                        f"{out['candidates_estimated']:,} | {out['candidates_simulated']} | {out['plan']} |")
            print(rows[-1], file=sys.stderr)
        sections.append(f"Headline cases (cold: empty trace cache; warm: the tracer's disk cache hit, best of {WARM_RUNS}; "
                        f"cold target: import floor {floor:.2f} s + 1 s + warm):\n\n" + "\n".join(rows))

        rows = [HEADER]
        soap_plan("llama-3-8b", 8, f"{tmp}/growth")  # fills the trace cache: the rows below are warm
        for gpus in GPU_GROWTH:
            seconds, out = soap_plan("llama-3-8b", gpus, f"{tmp}/growth")
            rows.append(_row("llama-3-8b", gpus, f"{seconds:.1f}", out))
            print(rows[-1], file=sys.stderr)
        sections.append("Growth with GPU count (llama-3-8b, warm):\n\n" + "\n".join(rows))

        rows = [HEADER]
        preset = json.loads((ROOT / "tracer" / "presets" / "llama-3-8b.json").read_text())
        for layers in LAYER_GROWTH:
            model = Path(tmp) / f"llama-3-8b-{layers}-layers"
            model.mkdir()
            (model / "config.json").write_text(json.dumps({**preset, "num_hidden_layers": layers}))
            soap_plan(str(model), 512, f"{tmp}/growth")
            seconds, out = soap_plan(str(model), 512, f"{tmp}/growth")
            rows.append(_row(f"llama-3-8b, {layers} layers", 512, f"{seconds:.1f}", out))
            print(rows[-1], file=sys.stderr)
        sections.append("Growth with layer count (llama-3-8b config, 512 GPUs, warm):\n\n" + "\n".join(rows))
    body = ("Wall time of `soap plan MODEL --gpus N --json` as a fresh subprocess: Python start-up, imports, "
            "tracing (cold) or the trace cache (warm), enumeration, estimates, simulations and the plan. "
            f"1-minute load average {load_before:.2f} before the benchmark and {os.getloadavg()[0]:.2f} after it "
            "(the machine is shared).\n\n" + "\n\n".join(sections))
    if args.no_write:
        print(body)
    else:
        update_section("plan-speed", "Plan speed: wall time of soap plan", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
