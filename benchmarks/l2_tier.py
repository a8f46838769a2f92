"""The shared tier against its transport's limit: fetching a prefix from a Valkey cluster into L1, and what
the tier costs a STORE.

* Fetch: a prefix of ``--gib`` GiB of chunk objects (Llama-3.1-8B's KV shape, ``--chunk`` tokens a chunk)
  is written to a three-node cluster on loopback; then, in this process, the client's own pipelined GETs of
  the same values (``mget_nonatomic``: the limit on this transport) against ``SharedTier.fill`` (the same GETs,
  the header and checksum check, and the copy into a fresh L1 pool). Both arms run ``--reps`` times,
  alternating.
* Store: a ``kvstrata serve`` with and one without ``--l2`` each STORE the same-size prompt from the reference
  engine (server placement: the server gathers the chunks); arms alternate, a fresh prompt each time.

    python benchmarks/l2_tier.py --gib 1 --out benchmarks/results/l2-tier-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from kvstrata.adapters.reference.engine import ModelShape  # noqa: E402

SHAPE = ModelShape(num_layers=32, kv_size=2, num_heads=8, head_size=128, dtype="bfloat16")
"""Llama-3.1-8B's KV per token (one tensor-parallel rank of 8 KV heads): a 256-token chunk is 32 MiB."""


def fetch_arms(cluster, gib: float, chunk: int, reps: int) -> dict:
    from kvstrata.adapters.reference.engine import ReferenceEngine
    from kvstrata.core.store.keys import CacheKey
    from kvstrata.core.store.l1_store import L1Store
    from kvstrata.core.store.l2.choose_backend import open_backend
    from kvstrata.core.store.l2.tier import SharedTier
    from kvstrata.core.store.l2.value import encode
    layout = ReferenceEngine(SHAPE, num_blocks=1, block_size=16).layout
    nbytes = layout.object_bytes(chunk)
    n = max(1, int(gib * (1 << 30)) // nbytes)
    key = CacheKey.for_tokens("bench", list(range(n * chunk)), model="bench-model")
    digests = key.chunk_hashes(chunk)[:n]
    backend = open_backend(cluster.addresses, timeout=30.0)
    shape, dtype = layout.shape_signature(), layout.dtype
    keys = [SharedTier.key(key, d, chunk, shape, dtype) for d in digests]
    payload = os.urandom(nbytes)
    for i in range(0, n, 16):
        backend.set_many([(k.name(), encode(k, payload)) for k in keys[i:i + 16]])
    names = [k.name() for k in keys]
    raw, tier_s = [], []
    for rep in range(reps + 1):
        started = time.perf_counter()
        values = backend.get_many(names)
        raw_t = time.perf_counter() - started
        assert all(v is not None and len(v) > nbytes for v in values)
        del values
        store = L1Store(n * nbytes + (16 << 20))
        tier = SharedTier(open_backend(cluster.addresses, timeout=30.0), store)
        tier.backend.get_many(names[:1] + names[-1:])  # its connections open before the clock starts, as raw's did
        started = time.perf_counter()
        filled = tier.fill(key, digests, [chunk] * n, shape, dtype)
        tier_t = time.perf_counter() - started
        assert filled == n, f"filled {filled} of {n}: {tier.stats()}"
        tier.close()
        store.close()
        if rep:  # the first of each is a warm-up
            raw.append(raw_t)
            tier_s.append(tier_t)
    total = n * nbytes
    out = {"chunks": n, "chunk_bytes": nbytes, "bytes": total,
           "raw_get_s": [round(t, 4) for t in raw], "tier_fill_s": [round(t, 4) for t in tier_s],
           "raw_get_gb_s": round(total / statistics.median(raw) / 1e9, 3),
           "tier_fill_gb_s": round(total / statistics.median(tier_s) / 1e9, 3)}
    out["fill_vs_raw"] = round(out["tier_fill_gb_s"] / out["raw_get_gb_s"], 3)
    backend.close()
    return out


def store_arms(cluster, gib: float, chunk: int, reps: int) -> dict:
    from kvstrata.adapters.reference.engine import ReferenceEngine
    from kvstrata.core.store.keys import CacheKey
    from kvstrata.core.wire.client import CacheClient
    from kvstrata.server_process import ServerProcess
    engine = ReferenceEngine(SHAPE, num_blocks=1, block_size=16)
    tokens = int(gib * (1 << 30)) // engine.layout.object_bytes(1) // chunk * chunk
    engine.close()
    pool = 3 * int(gib * (1 << 30)) + (64 << 20)
    arms = {"without": [], "with_l2": []}
    servers = {"without": ServerProcess(l1_bytes=pool, chunk_size=chunk),
               "with_l2": ServerProcess(l1_bytes=pool, chunk_size=chunk, extra_args=["--l2", cluster.addresses,
                                                                                      "--l2-write-queue", "4G"])}
    engine = ReferenceEngine(SHAPE, num_blocks=tokens // 16 + 4, block_size=16)
    try:
        clients = {}
        for name, srv in servers.items():
            srv.start(timeout=120)
            clients[name] = CacheClient(srv.address, timeout=300.0)
            clients[name].register_kv_cache(0, engine.layout, "server")
        blocks = engine.allocate(tokens)
        for rep in range(reps + 1):
            order = ("without", "with_l2") if rep % 2 == 0 else ("with_l2", "without")
            for name in order:
                prompt = [(rep * 7919 + i) % 32000 for i in range(tokens)]
                engine.prefill(prompt, blocks)
                started = time.perf_counter()
                reply = clients[name].store(CacheKey.for_tokens(f"s{rep}@i0", prompt, model=f"m-{name}"), 0,
                                            [blocks])
                elapsed = time.perf_counter() - started
                assert reply["stored_tokens"] == tokens, reply
                if rep:
                    arms[name].append(elapsed)
            info = clients["with_l2"].server_info()["l2"]
            deadline = time.monotonic() + 600
            while info["write_queue_bytes"] and time.monotonic() < deadline:  # the next STORE starts unqueued
                time.sleep(0.05)
                info = clients["with_l2"].server_info()["l2"]
        out = {"tokens": tokens, "bytes": tokens * engine.layout.object_bytes(1),
               **{f"{k}_s": [round(t, 4) for t in v] for k, v in arms.items()}}
        out["store_with_l2_vs_without"] = round(statistics.median(arms["with_l2"]) / statistics.median(arms["without"]), 3)
        out["l2"] = clients["with_l2"].server_info()["l2"]
        return out
    finally:
        engine.close()
        for srv in servers.values():
            srv.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--arms", default="fetch,store", help="which measurements: fetch, store or both")
    p.add_argument("--out")
    args = p.parse_args()
    arms = set(args.arms.split(","))
    from kvstrata_testing.valkey_cluster import ValkeyCluster

    with ValkeyCluster(tempfile.mkdtemp(prefix="kvstrata-bench-valkey-"),
                       maxmemory=f"{int(3 * args.gib * 1024) + 512}mb") as cluster:
        fetch = store = None
        if "fetch" in arms:
            fetch = fetch_arms(cluster, args.gib, args.chunk, args.reps)
            print(f"fetch {fetch['bytes'] >> 20} MiB in {fetch['chunks']} chunks: raw pipelined GETs "
                  f"{fetch['raw_get_gb_s']} GB/s, into L1 through the tier {fetch['tier_fill_gb_s']} GB/s "
                  f"({fetch['fill_vs_raw']}x; target 0.85x)", flush=True)
        if "store" in arms:
            store = store_arms(cluster, args.gib, args.chunk, args.reps)
            print(f"store {store['bytes'] >> 20} MiB: with --l2 {statistics.median(store['with_l2_s']):.3f} s, "
                  f"without {statistics.median(store['without_s']):.3f} s ({store['store_with_l2_vs_without']}x; target "
                  "1.05x)")
    result = {"benchmark": "l2_tier", "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                  "platform": platform.platform()},
              "config": vars(args), "fetch": fetch, "store": store}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
