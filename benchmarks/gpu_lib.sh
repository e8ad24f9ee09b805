# Sourced by the one-call GPU scripts (gpu_session.sh, gpu_session_h100_8b.sh): a work folder W packed into
# $OUT/session.tgz on exit (the device tool returns at most 8 files), and `step`, which runs one command under its
# own time limit, cut to what is left of DEADLINE seconds since the script began (default: no deadline), so that a
# slow step cannot take the others' results with it; the step times go to steps.txt, the machine to env.txt;
# `execute`, a step that runs soap's executor on a plan file, and `peft_versions`.
T0=$SECONDS
DEADLINE=${DEADLINE:-100000}
mkdir -p "$W"
export PYTHONUNBUFFERED=1 SOAP_PROFILES_DIR="$W/profiles" SOAP_RUNS_LOG="$W/runs.jsonl"
pack() { tar czf "$OUT/session.tgz" -C "$W" . 2>/dev/null; cp "$W/steps.txt" "$OUT/" 2>/dev/null; }
trap pack EXIT
step() {  # step LABEL SECONDS COMMAND...
    local label=$1 limit=$2; shift 2
    local left=$((DEADLINE - (SECONDS - T0)))
    [ "$left" -lt 25 ] && { echo "$label skipped (no time)" | tee -a "$W/steps.txt"; return; }
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" >"$W/$label.out" 2>"$W/$label.err"
    local rc=$?
    echo "$label rc=$rc $((SECONDS - t0))s (limit $limit)" | tee -a "$W/steps.txt"
    tail -4 "$W/$label.err"
}
execute() {  # execute LABEL SECONDS PLAN_DIR STEPS: soap's executor on PLAN_DIR/LABEL.plan.json, as a step
    step "$1" "$2" python3 -m soap execute "$3/$1.plan.json" --steps "$4" --report "$W/$1.run.json" --json
}
peft_versions() {  # the adapter stack a PEFT or optimizer session runs on, into env.txt and on screen
    python3 -c "import peft, bitsandbytes as b, transformers as t; print('peft', peft.__version__, 'bitsandbytes',
        b.__version__, 'transformers', t.__version__)" >>"$W/env.txt" 2>&1
    tail -1 "$W/env.txt"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  python3 -c "import torch, transformers, pydantic, ortools; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)"
  python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
  nproc; free -g | head -2; } >"$W/env.txt" 2>&1
cat "$W/env.txt"
