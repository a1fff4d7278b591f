import cProfile, pstats, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, "benchmarks")
import bench_sync as bs
bs.environment()
import torch, hwsync
from hwsync.verify import check
layers = int(sys.argv[1]) if len(sys.argv) > 1 else 24
strategy = sys.argv[2] if len(sys.argv) > 2 else "adapter"
path = bs._checkpoint(Path(tempfile.mkdtemp()), "tiny", layers)
llm = bs._engine(path, torch.float32, 8)
model = bs._trainer(path, strategy, 8, torch.float32)
P = [[1, 5, 9, 33, 70, 100, 7, 8]]
for i in range(3):
    bs._step(model, i); hwsync.sync(llm, model, strategy=strategy)
    t0 = time.perf_counter(); r = check(llm, model, P, logprobs=False); print(i, f"{time.perf_counter()-t0:.3f}s", r.ok, r.message()[:400])
bs._step(model, 9); hwsync.sync(llm, model, strategy=strategy)
pr = cProfile.Profile(); pr.enable(); t0 = time.perf_counter(); r = check(llm, model, P, logprobs=False); dt = time.perf_counter() - t0; pr.disable()
print("profiled", f"{dt:.3f}s", r.ok)
pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
