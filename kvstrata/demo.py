"""The quick start's main job: a server and the reference engine, one prompt stored and retrieved.

Everything is real: a ``kvstrata serve`` child process, ZMQ over a private IPC
socket, the L1 pool and the engine's paged cache in shared memory. Output is
what happened, with timings measured in this run.
"""

from __future__ import annotations

import time

import torch

from kvstrata.core.wire.client import CacheClient
from kvstrata.core.store.keys import CacheKey
from kvstrata.adapters.reference.engine import LLAMA_8B, ReferenceEngine
from kvstrata.server_process import ServerProcess
from kvstrata.core.engine.server_placement import ServerPlacement


def run_demo(tokens: int = 1024, layers_per_slice: int = 1) -> int:
    shape = LLAMA_8B
    kv_bytes = tokens * shape.kv_bytes_per_token()
    print(f"kvstrata demo: {tokens}-token prompt, {shape.num_layers} layers, {kv_bytes / 2**20:.0f} MiB of KV")
    num_blocks = 2 * (-(-tokens // 16)) + 8
    with ServerProcess(l1_bytes=max(2 * kv_bytes, 64 << 20), chunk_size=256) as server:
        engine = ReferenceEngine(shape, num_blocks=num_blocks, block_size=16)
        client = CacheClient(server.address)
        worker = ServerPlacement(client, 0, engine.layout)
        try:
            worker.register()
            prompt = torch.randint(0, 32000, (tokens,)).tolist()

            blocks = engine.allocate(tokens)
            engine.prefill(prompt, blocks)
            t = time.perf_counter()
            stored = client.store(CacheKey.for_tokens("demo-store", prompt, model="demo"), 0, [blocks])
            print(f"  STORE    {stored['stored_tokens']} tokens in {(time.perf_counter() - t) * 1e3:.1f} ms")
            engine.free(blocks)

            for width in (0, layers_per_slice):
                rid = f"demo-retrieve-w{width}"
                key = CacheKey.for_tokens(rid, prompt, model="demo")
                hit = client.lookup(key)
                dst = engine.allocate(tokens)
                engine.clear(dst)
                worker.submit_retrieve(rid, key, [dst], layers_per_slice=width)
                released = []
                while not released:
                    released = worker.get_finished()
                rec = worker.records[rid]
                in_flight = rid in worker.draining()
                for layer in range(shape.num_layers):
                    worker.wait_for_layer(layer)  # the engine's per-layer wait before reading a layer
                worker.wait_all()
                bad = engine.mismatched_layers(prompt, dst, 0, tokens)
                mode = "chunk-major" if width == 0 else f"layer-major, {width} layer(s) per slice"
                print(f"  RETRIEVE ({mode}): LOOKUP hit {hit} tokens; released after "
                      f"{(rec.released_at - rec.submitted_at) * 1e3:.1f} ms "
                      f"({'transfer still in flight' if in_flight else 'transfer already complete'}), "
                      f"complete after {(rec.completed_at - rec.submitted_at) * 1e3:.1f} ms; "
                      f"{shape.num_layers - len(bad)}/{shape.num_layers} layers byte-exact")
                engine.free(dst)
                if bad or rec.failure:
                    print(f"  FAILED: layers {bad} differ; failure: {rec.failure}")
                    return 1
            print("ok")
            return 0
        finally:
            worker.close()
            client.close()
            engine.close()
