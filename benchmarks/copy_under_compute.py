"""Diagnostic of the arm-to-arm spread: which part of a load decides how fast the copy engine moves it while the
engine computes.

In ``ttft.py`` one engine-placement arm can load slower under compute than another of identical settings, all of
it the copy engine's own host-to-staging time, decided by the order of the arms' first transfers and not by how
many copy streams a piece is split across. This takes the pieces apart. One source is the L1 pool as an engine maps
it (a private shared-memory segment, mapped read-only and registered for DMA), the others are further read-only
mappings of the same segment, pinned memory from CUDA's own allocator and, where the kernel gives it, anonymous
memory on transparent huge pages. Each trial copies one request's prefix (32 layer pieces of one 2D copy each, as
the copier plans them) from one source on one stream into two staging buffers, while the Llama-shaped layers of
``ttft.py`` compute on the default stream reading a TensorRT-LLM-format cache, and reports the copy engine's
busy time. Trials run in an order given on the command line, so a source's or stream's first use can be
placed anywhere.

    python benchmarks/copy_under_compute.py --out DIR/copy-under-compute.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

LAYERS, KV, HEADS, HEAD, BLOCK = 32, 2, 8, 128, 16
PREFIX = 15104
CHUNK = 256
ROW = HEADS * HEAD * 2  # bytes of one token of one layer of K (or V), bf16


def host_address(buf) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def thp_anonymous(size: int) -> tuple[mmap.mmap, int]:
    """Anonymous memory advised onto transparent huge pages (MADV_HUGEPAGE), touched so it is backed."""
    m = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    addr = host_address(m)
    ctypes.memset(addr, 1, size)
    return m, addr


def huge_pages_in(addr: int) -> int | None:
    """AnonHugePages or ShmemPmdMapped kB of the mapping holding ``addr`` (smaps), or None."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    total = 0
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
            total += int(line.split()[1])
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--order", default="map0,map1,map2,map3,map0,map1,map2,map3,cuda,thp,map0/s1,map1/s0",
                   help="trials in order: SOURCE or SOURCE/sSTREAM (a stream index; default the source's own)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of the whole order")
    p.add_argument("--new", type=int, default=256, help="new tokens the layers compute")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from ttft import Decoder, Shapes, prefix_reader
    from kvstrata.core.shm import Segment
    from kvstrata.native import cuda_ext
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from kvstrata_testing.gpu_caches import GpuKVCache  # engine-format GPU caches: test support, not shipped

    ext = cuda_ext.load()
    dev = torch.device("cuda", 0)
    objects = PREFIX // CHUNK
    plane = LAYERS * CHUNK * ROW  # one object's K (or V) for every layer
    piece_row = CHUNK * ROW  # one layer of one plane of one object
    size = objects * KV * plane
    seg = Segment.create("cuc", size)
    ctypes.memset(seg.address, 7, size)
    sources: dict[str, int] = {}
    keep: list = [seg]
    for i in range(4):  # read-only mappings of the segment, as an engine maps the server's pool
        view = Segment.attach(seg.name, size, readonly=True)
        keep.append(view)
        sources[f"map{i}"] = ext.host_register(host_address(view.buf), size, 0, True)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    sources["cuda"] = pinned.data_ptr()
    thp_info: dict[str, object] = {}
    try:
        thp_map, thp_addr = thp_anonymous(size)
        keep.append(thp_map)
        sources["thp"] = ext.host_register(thp_addr, size, 0, False)
        thp_info["huge_kb"] = huge_pages_in(thp_addr)
    except Exception as exc:  # noqa: BLE001 - a diagnostic: say what the kernel refused and go on
        thp_info["error"] = repr(exc)
    for f in ("enabled", "shmem_enabled"):
        try:
            thp_info[f] = open(f"/sys/kernel/mm/transparent_hugepage/{f}").read().strip()
        except OSError as exc:
            thp_info[f] = repr(exc)
    staging = [torch.empty(objects * KV * piece_row, dtype=torch.uint8, device=dev) for _ in range(2)]
    streams = {name: torch.cuda.Stream() for name in sources}
    streams.update({f"s{i}": streams[f"map{i}"] for i in range(4)})

    s = Shapes()
    cache = GpuKVCache("trtllm", num_layers=LAYERS, num_heads=HEADS, head_size=HEAD, dtype="bfloat16",
                       num_blocks=PREFIX // BLOCK + 1, block_size=BLOCK)
    read = prefix_reader(cache, list(range(PREFIX // BLOCK)), s)
    model = Decoder(s, dev)
    x0 = torch.randn(args.new, s.hidden, device=dev, dtype=torch.bfloat16)

    def compute() -> None:
        x = x0
        for layer in range(LAYERS):
            x = model.layer(layer, x, [read(layer)], args.new)
        model.logits(x, 1, args.new)

    def trial(source: str, stream_name: str, with_compute: bool) -> dict[str, float]:
        st = streams[stream_name]
        base = sources[source]
        torch.cuda.synchronize()
        marks = []
        if with_compute:  # enqueued on the default stream, twice so it outlasts the copies below
            compute()
            compute()
        rows = np.zeros(6, dtype=np.int64)
        for layer in range(LAYERS):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dst = staging[layer % 2].data_ptr()
            rows[:] = (dst, piece_row, base + layer * piece_row, plane, piece_row, objects * KV)
            a.record(st)
            ext.memcpy2d_runs(rows.ctypes.data, 1, 0, st.cuda_stream)
            b.record(st)
            marks.append((a, b))
        torch.cuda.synchronize()
        per = [a.elapsed_time(b) for a, b in marks]
        return {"busy_ms": round(sum(per), 3), "span_ms": round(marks[0][0].elapsed_time(marks[-1][1]), 3),
                "piece_ms_median": round(statistics.median(per), 4)}

    for _ in range(2):
        compute()
    torch.cuda.synchronize()
    trials = [t.strip() for t in args.order.split(",") if t.strip()]
    results: list[dict[str, object]] = []
    first_use: list[str] = []
    for rep in range(args.reps):
        for t in trials:
            source, _, stream_name = t.partition("/")
            stream_name = stream_name or source
            if source not in sources:
                results.append({"trial": t, "rep": rep, "error": f"no source {source!r}"})
                continue
            for name in (source, stream_name):
                if name not in first_use:
                    first_use.append(name)
            row = {"trial": t, "rep": rep, **trial(source, stream_name, True)}
            row["idle"] = trial(source, stream_name, False)
            results.append(row)
            print(json.dumps(row), flush=True)
    summary: dict[str, dict[str, float]] = {}
    for t in dict.fromkeys(trials):
        busy = [r["busy_ms"] for r in results if r["trial"] == t and "busy_ms" in r]
        idle = [r["idle"]["busy_ms"] for r in results if r["trial"] == t and "idle" in r]
        if busy:
            summary[t] = {"under_compute_busy_ms": round(statistics.mean(busy), 3),
                          "idle_busy_ms": round(statistics.mean(idle), 3), "n": len(busy)}
    out = {"benchmark": "copy_under_compute", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "bytes_per_trial": objects * KV * piece_row * LAYERS, "order": trials, "first_use": first_use,
           "thp": thp_info, "summary": summary, "trials": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({"thp": thp_info, "summary": summary}, indent=1))
    seg.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
