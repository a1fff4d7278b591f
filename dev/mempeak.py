"""Analyse a torch CUDA memory snapshot: the moment the live bytes allocated during the trace peak, and what is
alive then, grouped by the innermost hwsync/vllm/peft frame."""
import collections, pickle, sys

snap = pickle.load(open(sys.argv[1], "rb"))
for dev, trace in enumerate(snap["device_traces"]):
    if not trace:
        continue
    live = {}
    cur = peak = 0
    peak_live = None
    old = [0]
    old_at_peak = 0
    for ev in trace:
        a = ev["action"]
        if a == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
        elif a == "free_requested":
            e = live.pop(ev["addr"], None)
            cur -= ev["size"] if e is None else e["size"]
            if e is None:
                old[0] += ev["size"]
        if cur > peak:
            peak, peak_live, old_at_peak = cur, dict(live), old[0]
    print(f"device {dev}: {len(trace)} events, net at end {cur/1e9:.3f} GB, peak {peak/1e9:.3f} GB over the start (blocks from before the trace freed by then: {old_at_peak/1e9:.3f} GB; by the end {old[0]/1e9:.3f} GB)")

    def where(ev, depth=int(sys.argv[2]) if len(sys.argv) > 2 else 3):
        fr = [f for f in ev.get("frames", []) if any(k in f["filename"] for k in ("hwsync", "vllm", "peft", "bench"))]
        return " < ".join(f"{f['filename'].split('site-packages/')[-1].split('/main/')[-1]}:{f['line']}:{f['name']}"
                          for f in fr[:depth]) or "?"
    for title, group in (("alive at the peak", peak_live or {}), ("alive at the end", live)):
        by = collections.Counter()
        n = collections.Counter()
        for ev in group.values():
            by[where(ev)] += ev["size"]
            n[where(ev)] += 1
        print(f"  {title}: {sum(by.values())/1e9:.3f} GB")
        for k, v in by.most_common(15):
            print(f"    {v/1e9:8.3f} GB {n[k]:6d}x  {k}")
