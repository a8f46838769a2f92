"""Scratch (not product): ttft.py's main with one concurrency arm (TRACE_CONC requests, width TRACE_WIDTH) run once
under torch.profiler (CPU + CUDA, all threads); writes a summary ($OUT/trace-$TRACE_TAG.txt: engine-stream gaps,
copy-stream busy time, long CPU calls by thread, the arm's steps/releases/stages) and every event up to
TRACE_UNTIL_MS, gzipped ($OUT/trace-$TRACE_TAG.json.gz)."""
import collections, gzip, json, os, sys, tempfile
sys.path.insert(0, "benchmarks")
import ttft
from torch.profiler import ProfilerActivity, profile

CONC, WIDTH = int(os.environ.get("TRACE_CONC", 16)), int(os.environ.get("TRACE_WIDTH", 4))
TAG, UNTIL = os.environ.get("TRACE_TAG", "x"), float(os.environ.get("TRACE_UNTIL_MS", 500))
orig = ttft.run_arm
done = {"n": 0}

def traced(rig, client, model, placement, width, conc, new, *a, **kw):
    if conc != CONC or width != WIDTH or kw.get("serial") or done["n"]:
        return orig(rig, client, model, placement, width, conc, new, *a, **kw)
    done["n"] = 1
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        out = orig(rig, client, model, placement, width, conc, new, *a, **kw)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.json")
        prof.export_chrome_trace(path)
        ev = json.load(open(path))["traceEvents"]
    names = {(e.get("pid"), e.get("tid")): e["args"].get("name") for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("gpu_memcpy", "kernel", "gpu_memset")]
    t0 = min(e["ts"] for e in gpu)
    lines = [f"threads: {names}",
             f"mean_ttft_ms: {sum(out['ttft_ms']) / len(out['ttft_ms']):.1f}", f"steps: {out['steps']}",
             f"release_ms: {[round(x, 1) for x in out.get('release_ms', [])]}",
             f"transfer_ms: {[round(x, 1) for x in out.get('transfer_ms', [])]}",
             f"stages_ms: {out.get('stages_ms')}"]
    by_stream = collections.defaultdict(list)
    for e in gpu:
        by_stream[e.get("args", {}).get("stream", "?")].append(e)
    for s, es in sorted(by_stream.items(), key=lambda kv: str(kv[0])):
        es.sort(key=lambda e: e["ts"])
        busy = sum(e["dur"] for e in es)
        gaps = [(round((a["ts"] + a["dur"] - t0) / 1e3, 1), round((b["ts"] - a["ts"] - a["dur"]) / 1e3, 1))
                for a, b in zip(es, es[1:]) if b["ts"] - a["ts"] - a["dur"] > 2000]
        lines.append(f"stream {s}: {len(es)} ops, busy {busy / 1e3:.1f} ms, first {(es[0]['ts'] - t0) / 1e3:.1f}, "
                     f"last end {(es[-1]['ts'] + es[-1]['dur'] - t0) / 1e3:.1f}, gaps>2ms (end, gap) {gaps[:20]}")
    cpu = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")]
    per = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e in cpu:
        k = (e.get("tid"), e["name"])
        per[k][0] += 1; per[k][1] += e.get("dur", 0); per[k][2] = max(per[k][2], e.get("dur", 0))
    lines.append("runtime calls by (thread, name): count, total ms, max ms")
    for (tid, name), (n, tot, mx) in sorted(per.items(), key=lambda kv: -kv[1][1])[:40]:
        lines.append(f"  {names.get((None, tid), tid)} {tid} {name}: {n}, {tot / 1e3:.1f}, {mx / 1e3:.2f}")
    lines.append("runtime calls > 1 ms:")
    for e in sorted(cpu, key=lambda e: e["ts"]):
        if e.get("dur", 0) > 1000:
            lines.append(f"  {(e['ts'] - t0) / 1e3:8.1f} +{e['dur'] / 1e3:7.2f} tid {e.get('tid')} {e['name']}")
    with open(os.path.join(os.environ["OUT"], f"trace-{TAG}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    keep = [[e.get("name", "")[:80], e.get("cat"), e.get("tid"), e.get("args", {}).get("stream"),
             round(e["ts"] - t0, 1), e.get("dur", 0)] for e in ev
            if e.get("ph") == "X" and e.get("ts", 0) - t0 < UNTIL * 1e3]
    with gzip.open(os.path.join(os.environ["OUT"], f"trace-{TAG}.json.gz"), "wt") as f:
        json.dump({"threads": {str(k): v for k, v in names.items()}, "events": keep}, f)
    print("\n".join(lines[1:3]))
    return out

ttft.run_arm = traced
sys.exit(ttft.main(sys.argv[1:]))
