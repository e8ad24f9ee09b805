"""fp8 on one H100: four Llama-3-8B layers under torchao's float8 Linears, eager and compiled, against bf16.

    python -m benchmarks.fp8_h100

A lent H100 (2026-11-26, two calls: `benchmarks/gpu_session_fp8_peft.sh` and `_2.sh`) ran the step of
four Llama-3-8B layers (2 micro-batches of 8,192 tokens, no recompute, chunked loss) in fp8 compiled and eager,
with a compiled bf16 twin on the same machine; the eager bf16 twin outran its time limit there, so the eager
pair uses the same plan's bf16 run of 2026-11-26 on another H100 (its upcast loss costs the step +0.1% against the
chunked one: `benchmarks/chunked_loss_h100.py`). The same calls re-ran the 16k-token step whose memory the executor's
autocast change moved (`held_autocast_copies`). The runs logs (`benchmarks/data/h100-2026-11-26d/call*-runs.jsonl`,
`benchmarks/data/h100-runs-8b-shapes.jsonl`) hold each plan as run; this script re-prices each with the current
cost model on the default `dgx-h100` and the measured `h100-x1-measured` (as `benchmarks.gpu_repredict` does).
"""

from __future__ import annotations

import os
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
LOGS = (("h100-2026-11-26d/call1-runs.jsonl", "call 1"), ("h100-2026-11-26d/call2-runs.jsonl", "call 2"),
        ("h100-runs-8b-shapes.jsonl", "an earlier H100 (2026-11-26)"))
TWINS = (("8b4l-compile-fp8", "8b4l-compile-bf16"), ("8b4l-eager-fp8", "8b4l-eager"))
"""(fp8 run, its bf16 twin)."""
OTHER = ("8b4l-16k-chunked-eager",)
CLUSTERS = ("dgx-h100", "h100-x1-measured")


def records() -> list[dict]:
    """The fp8 runs, their bf16 twins and `OTHER`, each with where it ran."""
    from executor.runs_log import read_runs

    wanted = {name for pair in TWINS for name in pair} | set(OTHER)
    out = []
    for log, where in LOGS:
        for record in read_runs(str(DATA / log)):
            name = record["name"].removesuffix(".plan")
            if name in wanted and all(r["name"] != name for r in out):
                out.append(dict(record, name=name, where=where))
    return out


def rows() -> list[dict]:
    from benchmarks.gpu_repredict import priced
    from planner.plan import plan_from_dict

    out = []
    for record in records():
        p = plan_from_dict(record["plan"]).parallelism
        row = dict(name=record["name"], where=record["where"], precision=p.precision, compile=p.compile,
                   loss=p.cross_entropy, measured_s=record["step_time_s"], measured_gib=record["peak_memory_gib"],
                   reserved_gib=record.get("peak_memory_reserved_gib"))
        out.append(row | priced(record, {name: name for name in CLUSTERS}))
    return out


def markdown(table: list[dict]) -> str:
    def pct(p: float, m: float) -> str:
        return f"{100 * (p - m) / m:+.1f}%"

    by_name = {r["name"]: r for r in table}
    lines = ["| run | ran | precision | compile | loss | measured step | dgx-h100 | h100-x1-measured | "
             "measured memory (reserved) | dgx-h100 |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in table:
        (ds, dg), (hs, _) = r[CLUSTERS[0]], r[CLUSTERS[1]]
        reserved = f" ({r['reserved_gib']:.2f})" if r["reserved_gib"] else ""
        lines.append(f"| {r['name']} | {r['where']} | {r['precision']} | {'on' if r['compile'] else 'off'} | "
                     f"{r['loss']} | {r['measured_s'] * 1e3:.1f} ms | {ds * 1e3:.0f} ({pct(ds, r['measured_s'])}) | "
                     f"{hs * 1e3:.0f} ({pct(hs, r['measured_s'])}) | {r['measured_gib']:.2f}{reserved} GiB | "
                     f"{dg:.2f} ({pct(dg, r['measured_gib'])}) |")
    lines += ["", "fp8 against its bf16 twin (bf16 step over fp8 step: above 1, fp8 is faster):", "",
              "| pair | measured | dgx-h100 | h100-x1-measured | memory, measured | priced (dgx-h100) |",
              "|---|---:|---:|---:|---:|---:|"]
    for fp8_name, bf16_name in TWINS:
        fp8, bf16 = by_name.get(fp8_name), by_name.get(bf16_name)
        if fp8 is None or bf16 is None:
            continue
        ratio = [bf16[c][0] / fp8[c][0] for c in CLUSTERS]
        memory = (f"{fp8['measured_gib'] - bf16['measured_gib']:+.2f} GiB | "
                  f"{fp8[CLUSTERS[0]][1] - bf16[CLUSTERS[0]][1]:+.2f} GiB") if fp8["loss"] == bf16["loss"] else \
            f"not comparable: {fp8['loss']} loss against {bf16['loss']} |"
        lines.append(f"| {fp8_name} / {bf16_name} | {bf16['measured_s'] / fp8['measured_s']:.2f}x | {ratio[0]:.2f}x | "
                     f"{ratio[1]:.2f}x | {memory} |")
    lines += ["", READING]
    return "\n".join(lines)


READING = """Reading it:
- **Eager fp8 is slower than bf16** (1.61x the step), and soap priced it faster (1.14x on dgx-h100, 1.06x on
  h100-x1-measured): the casts were priced as
  the fused kernels a compiled run makes. torchao's float8 Linear (0.18) casts each operand op by op when eager
  (abs, max, four scalar kernels for the scale, to float32, multiply, clamp, to fp8: 33 bytes an element), and,
  having saved its input and weight in high precision, casts them again in backward beside the output gradient
  (twice) and copies three fp8 operands into `_scaled_mm`'s layouts. Counted that way (`costmodel.opcost.
  fp8_cast_kernels`), the eager fp8 step is priced 1.23x (dgx-h100) and 1.92x (h100-x1-measured) slower than
  bf16, around the measured 1.61x. The search already compiles every fp8 plan it makes (`planner.space.
  fp8_compiles`); this prices a pinned `--precision fp8 --no-compile` as it runs.
- **Compiled fp8 is 1.08x faster than bf16**, priced 1.18x (dgx-h100) and 1.09x (h100-x1-measured); 1.20x and
  1.13x until 2026-11-27 (session 25). The compiled casts are counted as two fused kernels (an amax, a scaled cast)
  and took the device's compile factor (x0.24-0.31) besides: a double discount for the weights' casts, which run
  whole, while Inductor fuses the activations' into their neighbours. Profiled on the same lent H100 ("torchao's
  compiled fp8 casts on one H100": 17.7 ms of four 8B layers' step, 31.6 ms of the 1B's), the factor on every cast
  priced them 2.4-4.2x short and no factor 1.1-1.9x over; soap now takes the factor on the activations' casts only
  (1.5-1.8x short on both). Dropping the factor on every cast had made the corpus fit worse on every check
  (torchtitan leaving out a GPU count 43.2% -> 45.9%) and put the refitted default's 1B above the published runs'
  MFU; with the split every check of the corpus fit moved by under a point, each a little better, and `dgx-h100`
  was refitted on it.
- **Memory: the float8 Linears keep no autocast copy.** Under bf16 autocast each block matmul's weight is cast to
  bf16 and cached for the backward; torchao casts the fp32 weight straight to fp8 and saves the fp32 weight
  itself. The eager fp8 step peaked at 42.29 GiB, 1.56 GiB under its bf16-regime price, the four blocks'
  linear weights in bf16 being 1.63 GiB; priced without those copies, 42.23 GiB (-0.1%). The compiled fp8 step
  peaked 3.0 GiB under its bf16 twin; priced without the copies it is still 1.8 GiB over (+4.8%): Inductor may
  save the fp8 casts of the linears' inputs rather than their bf16 sources, not modelled (one run, no snapshot).
- **GPT-2's fp8 runs were fp8 after all.** The executor rewrites GPT-2's Conv1Ds as Linears (for tensor
  parallelism) before the fp8 swap, so it converted them while the trace, seeing Conv1Ds, priced bf16: the lent
  H200's eager fp8 GPT-2 step ran 3.4x slower than bf16, unexplained until these eager casts were counted. The
  rewritten Linears now keep the bf16 regime, as priced (`tracer.fp8`, tested on GPT-2 and Llama).
- **fp8 with tensor parallelism did not run at all** (found while checking the executor against these prices):
  the float8 swap came after TP and dropped the TP styles' hooks. It now comes first, and on the CPU torchao
  emulates the float8 Linears, so `tests/test_fp8_execute.py` runs fp8 under TP, SP, FSDP2, pipelines (a
  compiled zero-bubble one), CP, EP and compile against one process, and fp8 cases join `plans_execute`.
- **The executor leaving autocast before the loss, measured**: the 16k chunked step peaked at 37.34 GiB, priced
  37.28 (it was 38.97 with autocast's 1.6 GiB of weight copies held over the loss).
- **LoRA and QLoRA did not run**: both outlasted their limit initializing the bf16 base on the CPU (call 2's
  faulthandler stack: `normal_` on a 16-bit tensor after 70 s). The seeded init now draws in fp32 and rounds
  (`executor.model.SeededInit`); the next lent H100 ran them (`benchmarks/peft_h100.py`)."""


def main() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from benchmarks.report import update_section

    body = markdown(rows())
    print(body)
    update_section("fp8-h100", "fp8 on one H100: torchao's float8 Linears eager and compiled, against bf16", body,
                   machine="runs measured on NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, torchao 0.18.0), "
                           "re-priced on this CPU")


if __name__ == "__main__":
    main()
