"""What registering the server's L1 pool for DMA costs an engine process, with the pool's pages allocated by the
server at its start (what ``kvstrata serve`` does) and without (the engine's registration faults them in).

An engine-placement engine registers the whole pool (``cudaHostRegister``) when it registers its cache, so
that cost delays the engine's start. For each size, the server side makes a pool the way ``L1Store`` does,
populated or not (the populate time is the server's start-up cost); then a fresh engine process maps it, as
``EnginePlacement`` does (read-only, or writable for engine-placement stores), and registers it.

    python benchmarks/pool_registration.py --gib 8,32 --out benchmarks/results/pool-registration-h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import warnings


def engine_side(name: str, size: int, writable: bool) -> dict:
    """In a fresh process: map the pool as an engine placement does and register it for DMA."""
    import torch

    from kvstrata.core.shm import Segment
    from kvstrata.native import cuda_ext
    from kvstrata.native.cuda_executor import pin_pool, unpin_pool

    ext = cuda_ext.load()
    torch.cuda.init()
    seg = Segment.attach(name, size, readonly=not writable)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pool = torch.frombuffer(seg.buf, dtype=torch.uint8, count=size)
    started = time.perf_counter()
    pin_pool(pool, 0, ext, read_only=not writable)
    register_s = time.perf_counter() - started
    started = time.perf_counter()
    unpin_pool(pool, ext)
    unregister_s = time.perf_counter() - started
    del pool
    seg.close()
    return {"register_s": round(register_s, 3), "unregister_s": round(unregister_s, 3)}


def measure(size: int, populate: bool, writable: bool) -> dict:
    from kvstrata.core.shm import Segment

    started = time.perf_counter()
    seg = Segment.create("bench-pool", size, populate=populate)
    made_s = time.perf_counter() - started
    try:
        proc = subprocess.run([sys.executable, __file__, "--engine-side", seg.name, str(size), str(int(writable))],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"engine side failed:\n{proc.stderr[-3000:]}")
        engine = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        seg.destroy()
    return {"gib": size / (1 << 30), "populated_by_server": populate, "engine_maps_writable": writable,
            "server_make_pool_s": round(made_s, 3), **engine}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", default="8,32", help="pool sizes, GiB")
    parser.add_argument("--out")
    parser.add_argument("--engine-side", nargs=3, metavar=("NAME", "SIZE", "WRITABLE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_side:
        name, size, writable = args.engine_side
        print(json.dumps(engine_side(name, int(size), bool(int(writable)))))
        return 0
    import torch

    rows = []
    for gib in (float(g) for g in args.gib.split(",")):
        size = int(gib * (1 << 30))
        for populate in (True, False):
            for writable in (False, True):
                row = measure(size, populate, writable)
                rows.append(row)
                print(f"{gib:5.1f} GiB  server populates: {populate!s:5}  engine maps writable: {writable!s:5}  "
                      f"server makes the pool in {row['server_make_pool_s']:6.2f} s, engine registers it in "
                      f"{row['register_s']:6.2f} s", flush=True)
    result = {"device": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                         "cuda": torch.version.cuda, "python": platform.python_version()},
              "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
