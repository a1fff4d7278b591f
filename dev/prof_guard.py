"""Profile TrainerSync's check (CPU, tiny shapes at depth): where the guard's time goes per tensor."""
import cProfile, pstats, sys, io
sys.path.insert(0, "benchmarks")
import hwsync.verify as ts
real = ts.check
prof = cProfile.Profile()
calls = [0]
def wrapped(*a, **k):
    calls[0] += 1
    if calls[0] <= 1:
        return real(*a, **k)
    prof.enable()
    try:
        return real(*a, **k)
    finally:
        prof.disable()
ts.check = wrapped
import bench_step
try:
    bench_step.main(sys.argv[1:])
finally:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(35)
    print(s.getvalue()[:9000])
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
    print(s.getvalue()[:6000])
