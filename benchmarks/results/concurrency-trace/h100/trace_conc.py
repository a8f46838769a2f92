"""Scratch (not product): ttft.py's main with its 16-request width-4 arm run once under torch.profiler; writes, per
10 ms of that arm, how many host-to-device copies and copy kernels each stream ran, and the arm's steps/releases."""
import collections, json, os, sys, tempfile
sys.path.insert(0, "benchmarks")
import ttft
from torch.profiler import ProfilerActivity, profile

orig = ttft.run_arm
done = {"n": 0}

def traced(rig, client, model, placement, width, conc, new, *a, **kw):
    if conc != 16 or width != 4 or kw.get("serial") or done["n"]:
        return orig(rig, client, model, placement, width, conc, new, *a, **kw)
    done["n"] = 1
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = orig(rig, client, model, placement, width, conc, new, *a, **kw)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.json")
        prof.export_chrome_trace(path)
        ev = json.load(open(path))["traceEvents"]
    gpu = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("gpu_memcpy", "kernel", "gpu_memset")]
    t0 = min(e["ts"] for e in gpu)
    buckets = collections.defaultdict(lambda: collections.Counter())
    streams = collections.Counter()
    for e in gpu:
        s = e.get("args", {}).get("stream", "?")
        kind = ("h2d" if "HtoD" in e["name"] else "memcpy") if e["cat"] == "gpu_memcpy" else (
            "scatter" if "copy_kernel" in e["name"] else "table" if "table" in e["name"] else "k")
        b = int((e["ts"] - t0) / 10000)
        buckets[b][f"{s}:{kind}"] += 1
        buckets[b][f"{s}:{kind}:us"] += e["dur"]
        streams[f"{s}:{kind}"] += 1
    lines = [f"streams: {dict(streams)}", f"steps: {out['steps']}",
             f"release_ms: {[round(x, 1) for x in out.get('release_ms', [])]}",
             f"transfer_ms: {[round(x, 1) for x in out.get('transfer_ms', [])]}",
             f"last_enqueued_ms: {[round(x, 1) for x in out.get('last_enqueued_ms', [])]}",
             f"stages_ms: {out.get('stages_ms')}"]
    for b in sorted(buckets):
        c = buckets[b]
        lines.append(f"{b * 10:5d} ms " + " ".join(f"{k}={v}" for k, v in sorted(c.items())))
    import gzip
    with gzip.open(os.path.join(os.environ["OUT"], "conc-gpu-events.json.gz"), "wt") as f:
        json.dump({"t0_us": t0, "events": [[e["name"][:60], e.get("args", {}).get("stream", "?"), e["cat"],
                                             round(e["ts"] - t0, 1), e["dur"]] for e in gpu],
                   "cpu": [[e["name"][:60], e.get("tid"), round(e["ts"] - t0, 1), e.get("dur", 0)] for e in ev
                           if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
                           and ("Sync" in e["name"] or e.get("dur", 0) > 300)]}, f)
    with open(os.path.join(os.environ["OUT"], "conc-trace.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:6]))
    return out

ttft.run_arm = traced
sys.exit(ttft.main(sys.argv[1:]))
