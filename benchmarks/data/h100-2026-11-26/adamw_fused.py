# Fused AdamW step time on the lent GPU: tensor size x total parameters x dtype (2026-11-26).
import json, statistics, time, torch
out = []
for dtype in (torch.float32, torch.bfloat16):
    for tensor in (2**15, 2**20, 2**22, 2**24):
        for total in (2**23, 2**26, 2**28):
            if tensor > total or total // tensor > 8192:
                continue
            n = total // tensor
            ps = [torch.nn.Parameter(torch.randn(tensor, device="cuda", dtype=dtype)) for _ in range(n)]
            for p in ps:
                p.grad = torch.randn_like(p)
            opt = torch.optim.AdamW(ps, lr=1e-4, fused=True)
            opt.step(); torch.cuda.synchronize()
            ts = []
            for _ in range(6):
                torch.cuda.synchronize(); t = time.perf_counter(); opt.step(); torch.cuda.synchronize()
                ts.append(time.perf_counter() - t)
            s = statistics.median(ts[1:])
            row = dict(dtype=str(dtype), tensor=tensor, total=total, seconds=s)
            print(json.dumps(row), flush=True); out.append(row)
            del opt, ps; torch.cuda.empty_cache()
import os
json.dump(out, open(os.environ["OUT"] + "/adamw.json", "w"), indent=1)
