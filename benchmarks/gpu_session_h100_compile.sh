#!/usr/bin/env bash
# Lent H100, 2026-11-26 (second session): where a compiled step of the 8B's layers goes (torch.profiler), and
# what is live at the memory peak of the 16k selective run, compiled and eager (soap execute --memory-snapshot).
#   run: python3 -m pip install ... --target /tmp/site .whl/*.whl .whl-tf/*.whl; DEADLINE=300 bash THIS (116 s on an H100)
set -u
W=/tmp/gs2; DEADLINE=${DEADLINE:-330}
source benchmarks/gpu_lib.sh
step profile-compile 170 python3 -m benchmarks.gpu_step_profile benchmarks/configs/llama-3-8b-4l.json 1 8192 --compile --json "$W/step-profile-compile.json"
snap() { step "$1" "$2" python3 -m soap execute "benchmarks/data/h100-2026-11-26/plans/$1.plan.json" --steps "$3" --report "$W/$1.run.json" --memory-snapshot "$W/snap-$1" --json
  [ -s "$W/snap-$1/rank0.pickle" ] && python3 -m benchmarks.memory_snapshot_peak "$W/snap-$1/rank0.pickle" --json "$W/$1.peak.json" > "$W/$1.peak.txt" 2>&1
  cat "$W/$1.peak.txt" 2>/dev/null | head -30
  gzip -c "$W/snap-$1/rank0.pickle" > "$OUT/$1.pickle.gz" 2>/dev/null; rm -rf "$W/snap-$1"; }
snap 8b4l-16k 100 4
snap 8b4l-16k-eager 70 3
cat "$W/steps.txt"
