"""What is live at a step's memory peak: read a CUDA memory snapshot (`soap execute --memory-snapshot DIR`)
and name the tensors held when allocated memory peaks.

    python -m benchmarks.memory_snapshot_peak DIR/rank0.pickle [--json OUT.json] [--top 25]

The snapshot holds the allocator's state when it was written (`segments`, every block with its state) and
the history of one step (`device_traces`: alloc / free events, each with the Python frames that made it).
Replayed backwards from the final state, the history gives the allocated bytes after each event:

    live_before_step = sum(active blocks at the end) - sum(allocs in the step) + sum(frees in the step)
    live(i)          = live_before_step + sum over events <= i of (+size for alloc, -size for free_completed)

The peak is the max of live(i). The bytes live there are those held from before the step (parameters,
gradients, optimizer states: the step's history cannot say which) and the step's allocations not yet freed,
grouped by where they were made: the innermost frame in model or executor code (a transformers model file,
soap's executor, Inductor's generated code), else the innermost frame.
"""

from __future__ import annotations

import argparse
import collections
import json
import pickle
from pathlib import Path

GIB = 2**30
_OWN = ("transformers/models", "executor/", "torchinductor", "torch/nn/functional", "torch/utils/checkpoint",
        "costmodel/", "torch/optim")


def _where(frames: list[dict]) -> str:
    for frame in frames:
        if any(mark in frame.get("filename", "") for mark in _OWN):
            return f"{Path(frame['filename']).name}:{frame.get('line')} {frame.get('name')}"
    if frames:
        frame = frames[0]
        return f"{Path(frame.get('filename', '?')).name}:{frame.get('line')} {frame.get('name')}"
    return "(no frames)"


def peak(snapshot: dict, device: int = 0, top: int = 25) -> dict:
    trace = snapshot["device_traces"][device]
    live_end = sum(b["size"] for seg in snapshot["segments"] if seg.get("device", 0) == device
                   for b in seg["blocks"] if b["state"] == "active_allocated")
    allocs = [e for e in trace if e["action"] == "alloc"]
    frees = [e for e in trace if e["action"] == "free_completed"]
    live_before = live_end - sum(e["size"] for e in allocs) + sum(e["size"] for e in frees)
    live, best, best_at = live_before, live_before, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live += e["size"]
        elif e["action"] == "free_completed":
            live -= e["size"]
        if live > best:
            best, best_at = live, i
    held: dict[int, dict] = {}
    for e in trace[:best_at + 1]:
        if e["action"] == "alloc":
            held[e["addr"]] = e
        elif e["action"] == "free_completed":
            held.pop(e["addr"], None)
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for e in held.values():
        g = groups[_where(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
    at = trace[best_at] if best_at >= 0 else {}
    return {
        "peak_allocated_gib": best / GIB,
        "held_from_before_step_gib": live_before / GIB,
        "allocated_in_step_and_held_gib": (best - live_before) / GIB,
        "live_at_end_gib": live_end / GIB,
        "events": len(trace),
        "peak_event": best_at,
        "peak_made_at": _where(at.get("frames", [])),
        "peak_stack": [f"{Path(f.get('filename', '?')).name}:{f.get('line')} {f.get('name')}"
                       for f in at.get("frames", [])[:14]],
        "held_by_site": [{"site": k, "gib": v[0] / GIB, "tensors": v[1]}
                         for k, v in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("snapshot", help="a rank's .pickle from `soap execute --memory-snapshot DIR`")
    parser.add_argument("--json", help="write the result here too")
    parser.add_argument("--top", type=int, default=25, help="sites to list (default 25)")
    args = parser.parse_args()
    with open(args.snapshot, "rb") as f:
        result = peak(pickle.load(f), top=args.top)
    print(f"peak allocated {result['peak_allocated_gib']:.2f} GiB at event {result['peak_event']} of "
          f"{result['events']} ({result['peak_made_at']}); held from before the step "
          f"{result['held_from_before_step_gib']:.2f} GiB, allocated in the step and held "
          f"{result['allocated_in_step_and_held_gib']:.2f} GiB")
    for row in result["held_by_site"]:
        print(f"  {row['gib']:7.3f} GiB  {row['tensors']:5d}  {row['site']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
