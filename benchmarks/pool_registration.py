"""What registering the server's L1 pool for DMA costs an engine process, with the pool's pages allocated by the
server at its start (what ``kvstrata serve`` does) and without (the engine's registration faults them in).

Registered before it serves (``cudaHostRegister`` of the whole pool), that cost would delay an engine's start, so
an engine-placement engine registers the pool on a thread of its own
(:class:`~kvstrata.native.host_pinning.PoolPinning`) while its copies already run. For each size, the server side
makes a pool the way ``L1Store`` does, populated or not (the populate time is the server's start-up cost); then a
fresh engine process maps it, as ``EnginePlacement`` does (read-only, or writable for engine-placement stores), and
registers it:

* ``at once``: one registration of the whole pool, what the engine's start would wait;
* ``background``: what the start waits (the constructor), how long the registration takes, and meanwhile what the
  engine sees: a copy of 256 MiB from the pool (pageable until registered) and a tiny kernel's round trip, on
  the engine's thread, against the same after the registration.
* once a run (``pieces_check`` in the JSON): a copy whose source spans two registrations of adjacent halves (why
  the pool is registered in one call).

    python benchmarks/pool_registration.py --gib 8,32 --out benchmarks/results/pool-registration-h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import warnings


COPY_BYTES = 256 << 20


def engine_side(name: str, size: int, writable: bool, background: bool) -> dict:
    """In a fresh process: map the pool as an engine placement does and register it for DMA."""
    import torch

    from kvstrata.core.shm import Segment
    from kvstrata.native import cuda_ext
    from kvstrata.native.host_pinning import PoolPinning

    ext = cuda_ext.load()
    torch.cuda.init()
    seg = Segment.attach(name, size, readonly=not writable)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pool = torch.frombuffer(seg.buf, dtype=torch.uint8, count=size)
    dev = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    tick = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()

    def copy_s(src: int) -> float:
        rows = torch.tensor([[dev.data_ptr(), src, COPY_BYTES]], dtype=torch.int64)
        t = time.perf_counter()
        ext.memcpy_runs(rows.data_ptr(), 1, 0, stream.cuda_stream)
        stream.synchronize()
        return time.perf_counter() - t

    def kernel_s() -> float:
        t = time.perf_counter()
        tick.add_(1)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    out: dict = {}
    started = time.perf_counter()
    pinning = PoolPinning(pool, 0, ext, read_only=not writable, background=background)
    out["register_s"] = round(time.perf_counter() - started, 3)  # what the engine's start waits
    if background:
        last = pool.data_ptr() + size - COPY_BYTES
        during_copy, during_kernel = [], []
        while not pinning.done():
            during_copy.append(copy_s(last))
            for _ in range(20):
                during_kernel.append(kernel_s())
        pinning.wait()
        if pinning.error is not None:
            raise pinning.error
        out["background_s"] = round(pinning.finished_at - pinning.started_at, 3)
        after_copy = [copy_s(last) for _ in range(5)]
        after_kernel = [kernel_s() for _ in range(200)]
        out["copy_256mib_gbps_while_registering"] = [round(COPY_BYTES / t / 1e9, 2) for t in during_copy]
        out["copy_256mib_gbps_after"] = round(COPY_BYTES / statistics.median(after_copy) / 1e9, 2)
        out["kernel_round_trip_ms_while_registering"] = {"median": round(statistics.median(during_kernel) * 1e3, 3),
                                                          "max": round(max(during_kernel) * 1e3, 3),
                                                          "n": len(during_kernel)}
        out["kernel_round_trip_ms_after"] = {"median": round(statistics.median(after_kernel) * 1e3, 3),
                                             "max": round(max(after_kernel) * 1e3, 3)}
    started = time.perf_counter()
    pinning.close()
    out["unregister_s"] = round(time.perf_counter() - started, 3)
    del pool
    seg.close()
    return out


def pieces_check() -> dict:
    """A copy-engine copy whose source spans two registrations (two halves of one pinned-by-parts buffer)."""
    import torch

    from kvstrata.native import cuda_ext
    from kvstrata.native.host_pinning import pin_host_range, unpin_host_range

    ext = cuda_ext.load()
    host = torch.randint(0, 256, (2 * COPY_BYTES,), dtype=torch.uint8)
    base, half = host.data_ptr(), COPY_BYTES
    dev = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    for addr in (base, base + half):
        pin_host_range(addr, half, 0, ext, what="a half")
    try:
        rows = torch.tensor([[dev.data_ptr(), base + half // 2, COPY_BYTES]], dtype=torch.int64)
        try:
            ext.memcpy_runs(rows.data_ptr(), 1, 0, stream.cuda_stream)
            stream.synchronize()
            return {"copy_across_two_registrations": "ran",
                    "bytes_equal": bool(dev.cpu().equal(host[half // 2:half // 2 + COPY_BYTES]))}
        except RuntimeError as exc:
            return {"copy_across_two_registrations": f"failed: {exc}"}
    finally:
        for addr in (base, base + half):
            unpin_host_range(addr, half, ext)


def measure(size: int, populate: bool, writable: bool, background: bool) -> dict:
    from kvstrata.core.shm import Segment

    started = time.perf_counter()
    seg = Segment.create("bench-pool", size, populate=populate)
    made_s = time.perf_counter() - started
    try:
        proc = subprocess.run([sys.executable, __file__, "--engine-side", seg.name, str(size), str(int(writable)),
                               str(int(background))],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"engine side failed:\n{proc.stderr[-3000:]}")
        engine = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        seg.destroy()
    return {"gib": size / (1 << 30), "populated_by_server": populate, "engine_maps_writable": writable,
            "registration": "background" if background else "at once", "server_make_pool_s": round(made_s, 3),
            **engine}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", default="8,32", help="pool sizes, GiB")
    parser.add_argument("--out")
    parser.add_argument("--populate", default="1,0", help="server populates the pool: 1, 0 or both")
    parser.add_argument("--registration", default="background,at-once")
    parser.add_argument("--writable", default="0,1", help="the engine maps the pool writable: 1, 0 or both")
    parser.add_argument("--engine-side", nargs=4, metavar=("NAME", "SIZE", "WRITABLE", "BACKGROUND"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_side:
        name, size, writable, background = args.engine_side
        print(json.dumps(engine_side(name, int(size), bool(int(writable)), bool(int(background)))))
        return 0
    import torch

    rows = []
    for gib in (float(g) for g in args.gib.split(",")):
        size = int(gib * (1 << 30))
        for populate in (bool(int(p)) for p in args.populate.split(",")):
            for writable in (bool(int(w)) for w in args.writable.split(",")):
                for registration in args.registration.split(","):
                    row = measure(size, populate, writable, registration == "background")
                    rows.append(row)
                    print(f"{gib:5.1f} GiB  server populates: {populate!s:5}  engine maps writable: {writable!s:5}  "
                          f"{registration:10}  server makes the pool in {row['server_make_pool_s']:6.2f} s, engine "
                          f"waits {row['register_s']:6.2f} s" + (f", registered in {row['background_s']:6.2f} s"
                                                                 if "background_s" in row else ""), flush=True)
    result = {"pieces_check": pieces_check(), "device": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                         "cuda": torch.version.cuda, "python": platform.python_version()},
              "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
