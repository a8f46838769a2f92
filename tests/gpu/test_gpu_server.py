"""Layer-major retrieve on a GPU through a real `kvstrata serve` process, every engine format.

The engine side is this process: its KV cache is allocated the way the engine
allocates it, registered by CUDA IPC, and read through the engine's own views.
The server side is a child process that opened that cache from the IPC handles
and copies from its pinned L1 pool on its own stream, recording the worker's
interprocess events per slice. Each width retrieves into its own shuffled
destination blocks, so a width that dropped a layer, wrote one twice or put it
at the wrong offset differs from the stored bytes there. Reads are enqueued
right after each layer's wait, on the engine's stream, while later slices may
still be copying.
"""

from __future__ import annotations


import pytest
import torch

from kvstrata.core.wire.client import CacheClient
from kvstrata.core.store.keys import CacheKey
from kvstrata.adapters.reference.engine import ModelShape, ReferenceEngine
from kvstrata.core.engine.server_placement import ServerPlacement

from gpu_helpers import FORMAT_CASES, WIDTHS, next_instance_id, release_then_read, shuffled_blocks

TOKENS = 300  # chunk 64 on the server: four full chunks and a partial one
SKIP = 0


def _prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (TOKENS,), generator=g).tolist()


@pytest.mark.parametrize("fmt,dtype", FORMAT_CASES)
def test_widths_match_the_stored_blocks_and_chunk_major(gpu_server, fmt, dtype):
    from kvstrata.native.cuda_events import CudaEventBackend
    from kvstrata_testing.gpu_caches import GpuKVCache

    nb = -(-TOKENS // 16)
    cache = GpuKVCache(fmt, num_layers=32, num_heads=4, head_size=64, dtype=dtype,
                       num_blocks=(len(WIDTHS) + 2) * nb + 2, block_size=16)
    backend = CudaEventBackend("cuda:0")
    client = CacheClient(gpu_server.address, timeout=60.0)
    iid = next_instance_id()
    worker = ServerPlacement(client, iid, cache.layout, event_backend=backend)
    try:
        reply = worker.register()
        assert reply["device"] == "cuda:0"
        seed = next_instance_id()
        prompt = _prompt(seed)
        truth = cache.random_kv(TOKENS, seed=seed)
        src = shuffled_blocks(0, nb, seed=seed)
        cache.write(truth, src)
        # The server waits on this event (on its stream) before gathering.
        stored = client.store(CacheKey.for_tokens(f"store-{iid}", prompt, model=fmt), iid, [src],
                              event_handle=backend.store_event_handle())
        assert stored["stored_tokens"] == TOKENS
        cache.poison(src)  # the source is gone; only the L1 copy can fill the destinations

        per_width = {}
        signals = client.server_info()["gpu_signals"]
        for i, width in enumerate([0] + WIDTHS):
            rid = f"{fmt}-{dtype}-w{width}"
            key = CacheKey.for_tokens(rid, prompt, model=fmt, dtype=dtype)
            assert client.lookup(key) == TOKENS
            dst = shuffled_blocks((i + 1) * nb, nb, seed=100 + i)
            cache.poison(dst)
            torch.cuda.synchronize()
            worker.submit_retrieve(rid, key, [dst], layers_per_slice=width)
            _, reads = release_then_read(worker, rid, lambda layer: cache.read(dst, 0, TOKENS, [layer]),
                                         cache.num_layers)
            rec = worker.records[rid]
            assert rec.failure is None and rec.fallback is None, rec
            assert rec.layers_per_slice == width
            for layer, got in enumerate(reads):
                assert got.equal(truth[:, layer:layer + 1]), f"{fmt}/{dtype} width {width}: layer {layer} differs"
            per_width[width] = reads
        for width in WIDTHS:  # the knob changes when bytes arrive, not which
            for layer in range(cache.num_layers):
                assert per_width[width][layer].equal(per_width[0][layer]), (width, layer)
        info = client.server_info()
        assert info["l1"]["locked_objects"] == 0
        # Every layer-major retrieve's end was stored by the GPU itself (its board's "complete" word), and
        # the reads above, enqueued the moment the engine learned of it, already saw every byte.
        assert info["gpu_signals"] == signals + len(WIDTHS), info["gpu_signals"] - signals
    finally:
        worker.close()
        client.unregister_kv_cache(iid)
        client.close()


@pytest.mark.parametrize("fmt,dtype", FORMAT_CASES)
def test_chunks_stored_from_a_gpu_read_back_canonically_on_cpu(gpu_server, fmt, dtype):
    """What a GPU engine stores is the canonical [kv, layer, token, head, byte] object:
    the CPU reference engine, retrieving it through the pure-torch oracle, reads the same bytes."""
    from kvstrata.native.cuda_events import CudaEventBackend
    from kvstrata_testing.gpu_caches import GpuKVCache

    nb = -(-TOKENS // 16)
    cache = GpuKVCache(fmt, num_layers=32, num_heads=4, head_size=64, dtype=dtype, num_blocks=nb + 1,
                       block_size=16)
    backend = CudaEventBackend("cuda:0")
    client = CacheClient(gpu_server.address, timeout=60.0)
    gpu_iid, cpu_iid = next_instance_id(), next_instance_id()
    cpu = ReferenceEngine(ModelShape(32, cache.kv_size, cache.num_heads, cache.head_size, dtype),
                          num_blocks=nb + 1, block_size=16)
    try:
        client.register_kv_cache(gpu_iid, cache.layout, "server")
        client.register_kv_cache(cpu_iid, cpu.layout, "server")
        prompt = _prompt(gpu_iid)
        truth = cache.random_kv(TOKENS, seed=gpu_iid)
        src = shuffled_blocks(0, nb, seed=1)
        cache.write(truth, src)
        client.store(CacheKey.for_tokens("s", prompt, model=fmt), gpu_iid, [src],
                     event_handle=backend.store_event_handle())
        key = CacheKey.for_tokens("cpu-read", prompt, model=fmt, dtype=dtype)
        assert client.lookup(key) == TOKENS
        dst = cpu.allocate(TOKENS)
        cpu.clear(dst)
        client.retrieve(key, cpu_iid, [dst])
        host_truth = truth.cpu()
        for layer in range(32):
            assert cpu.read_layer(layer, dst, 0, TOKENS).equal(host_truth[:, layer]), f"layer {layer}"
    finally:
        for iid in (gpu_iid, cpu_iid):
            client.unregister_kv_cache(iid)
        client.close()
        cpu.close()
