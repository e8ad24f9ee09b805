# Where an eager bf16-autocast step of four Llama-3-8B layers goes on the lent H100 (2026-11-26), and the
# layers' GEMM shapes timed alone, in bursts and sustained for 3 s.
# Run from the repository root on a CUDA machine: python3 benchmarks/data/h100-2026-11-26/step_profile_8b4l.py (writes $OUT/prof.json).
import collections, json, os, subprocess, sys, time
import torch, torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, os.getcwd())
from tracer import build_model, resolve_spec
OUT = os.environ["OUT"]
res = {}
def mm_rate(m, k, n, seconds):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16); b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3): a @ b
    torch.cuda.synchronize(); t = time.perf_counter(); it = 0
    while time.perf_counter() - t < seconds:
        for _ in range(10): a @ b
        it += 10; torch.cuda.synchronize()
    return 2 * m * k * n * it / (time.perf_counter() - t) / 1e12
shapes = {"qkv": (8192, 4096, 6144), "o": (8192, 4096, 4096), "gate_up": (8192, 4096, 28672), "down": (8192, 14336, 4096), "lm_head": (8192, 4096, 128256), "wgrad_down": (14336, 8192, 4096)}
res["burst_tflops"] = {k: mm_rate(*s, 0.05) for k, s in shapes.items()}
clk = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader", "-lms", "500"], stdout=subprocess.PIPE, text=True)
res["sustained_tflops_gate_up_4s"] = mm_rate(*shapes["gate_up"], 4.0)
clk.terminate(); res["clocks_during_sustained"] = clk.stdout.read().strip().splitlines()
print(json.dumps(res, indent=1), flush=True)
model = build_model(resolve_spec("benchmarks/configs/llama-3-8b-4l.json"), device="cuda")
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
ids = torch.randint(0, model.config.vocab_size, (1, 8192), device="cuda")
def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
for _ in range(3): step()
ts = []
for _ in range(5):
    torch.cuda.synchronize(); t = time.perf_counter(); step(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
res["step_s_mb1_seq8192"] = sorted(ts)[2]
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    step(); torch.cuda.synchronize()
kern = collections.Counter(); calls = collections.Counter()
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        kern[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total; calls[e.name] += 1
res["kernels_us"] = [[n[:140], round(t), calls[n]] for n, t in kern.most_common(60)]
res["kernel_total_us"] = sum(kern.values()); res["kernel_count"] = sum(calls.values())
json.dump(res, open(OUT + "/prof.json", "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k != "kernels_us"}, indent=1))
for r in res["kernels_us"][:30]: print(r)
