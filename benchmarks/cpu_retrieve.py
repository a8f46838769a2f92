"""CPU retrieve benchmark: time to release and to completion per slice width, against a raw memcpy.

Not a test: it prints a table and writes JSON (benchmarks/results/cpu-retrieve.json
by default) with the machine it ran on. Everything is real: a `kvstrata serve`
child process, ZMQ over IPC, the reference engine's cache in shared memory.

    python benchmarks/cpu_retrieve.py --tokens 2048 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from kvstrata.core.wire.client import CacheClient
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.transfer.layouts import PLACEMENT_SERVER, PLACEMENT_ENGINE
from kvstrata.adapters.reference.engine import LLAMA_8B, ReferenceEngine
from kvstrata.server_process import ServerProcess
from kvstrata.core.engine.placement import Placement
from kvstrata.core.engine.choose_placement import make_placement

WIDTHS = [0, 1, 2, 4, 8, 32]


def raw_memcpy_ms(nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def run_one(worker: Placement, client: CacheClient, engine: ReferenceEngine, prompt: list[int],
            width: int, rid: str) -> tuple[float, float]:
    key = CacheKey.for_tokens(rid, prompt, model="bench")
    client.lookup(key)
    dst = engine.allocate(len(prompt))
    try:
        worker.submit_retrieve(rid, key, [dst], layers_per_slice=width)
        while rid not in worker.get_finished():
            time.sleep(2e-5)  # an engine polls between steps; a hot spin holds the GIL the copy threads need
        for layer in range(engine.shape.num_layers):
            worker.wait_for_layer(layer)
        worker.wait_all()
        rec = worker.records[rid]
        if rec.failure:
            raise RuntimeError(rec.failure)
        return (rec.released_at - rec.submitted_at) * 1e3, (rec.completed_at - rec.submitted_at) * 1e3
    finally:
        engine.free(dst)


def main() -> int:
    from provenance import measured_commit  # a sibling script (benchmarks/ is first on the path when run)

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu-retrieve.json"))
    args = ap.parse_args()
    shape = LLAMA_8B
    nbytes = args.tokens * shape.kv_bytes_per_token()
    result = {
        "benchmark": "cpu_retrieve", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": measured_commit(),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
        "shape": {"layers": shape.num_layers, "kv_heads": shape.num_heads, "head_size": shape.head_size,
                  "dtype": shape.dtype, "tokens": args.tokens, "chunk_size": 256, "bytes": nbytes},
        "repeats": args.repeats, "raw_memcpy_ms": raw_memcpy_ms(nbytes, args.repeats), "placements": {},
    }
    with ServerProcess(l1_bytes=nbytes + (64 << 20), chunk_size=256) as srv:
        client = CacheClient(srv.address, timeout=120)
        engine = ReferenceEngine(shape, num_blocks=2 * (args.tokens // 16) + 2, block_size=16)
        prompt = torch.randint(0, 32000, (args.tokens,)).tolist()
        blocks = engine.allocate(args.tokens)
        engine.prefill(prompt, blocks)
        client.register_kv_cache(0, engine.layout, PLACEMENT_SERVER)
        client.store(CacheKey.for_tokens("store", prompt, model="bench"), 0, [blocks])
        engine.free(blocks)
        for placement in (PLACEMENT_SERVER, PLACEMENT_ENGINE):
            worker = make_placement(placement, client, 0, engine.layout, local_regions=engine.regions)
            worker.register()
            rows = {}
            for width in WIDTHS:
                run_one(worker, client, engine, prompt, width, f"warm-{placement}-{width}")
                samples = [run_one(worker, client, engine, prompt, width, f"{placement}-{width}-{i}")
                           for i in range(args.repeats)]
                rows[str(width)] = {"release_ms": statistics.median(s[0] for s in samples),
                                    "complete_ms": statistics.median(s[1] for s in samples)}
            worker.close()
            result["placements"][placement] = rows
        engine.close()
        client.close()
    print(f"{nbytes / 2**20:.0f} MiB retrieve, raw memcpy {result['raw_memcpy_ms']:.1f} ms "
          f"({result['machine']['cpus']} CPUs)")
    for placement, rows in result["placements"].items():
        print(f"  {placement} placement   width  release ms  complete ms")
        for width, r in rows.items():
            label = "chunk" if width == "0" else width
            print(f"  {'':>18} {label:>6} {r['release_ms']:>11.1f} {r['complete_ms']:>12.1f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
