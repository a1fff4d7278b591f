. /tmp/gk/env.sh; export PYTHONUNBUFFERED=1
bash /tmp/gk/kit/device-install.sh --project > /dev/null 2>&1
timeout 100 python - <<'PY'
import torch, time
src=[torch.randn(int(59.5e9/2/384), device="cuda").to(torch.bfloat16) for _ in range(384)]
dst=[torch.empty_like(t) for t in src]
for _ in range(2):
    torch.cuda.synchronize(); t0=time.perf_counter()
    for d,s in zip(dst,src): d.copy_(s)
    torch.cuda.synchronize(); print("copy_ per tensor", time.perf_counter()-t0)
PY
timeout 100 python benchmarks/bench_isfinite.py --gb 60 --device cuda --repeat 3 --sweep 2>&1 | tail -20
