# Run from the repository root on a CUDA machine: the step soap calibrate --device cuda now profiles, and its k
# against the calibration of 2026-11-26 (writes $OUT/step.json).
import json, os, sys, time
sys.path.insert(0, os.getcwd())
t = time.time()
from costmodel.calibration.step_factor import measure_step, apply_step_factor
m = measure_step()
print("groups", {k: round(v * 1e3, 2) for k, v in m.items()}, "in", round(time.time() - t, 1), "s", flush=True)
d = json.load(open("benchmarks/data/h100-2026-11-26/calibrate-output.json"))
_, k = apply_step_factor(d, m, source="x")
print("k", k)
json.dump({"groups_s": m, "k_on_calibrate_output": k}, open(os.environ["OUT"] + "/step.json", "w"))
