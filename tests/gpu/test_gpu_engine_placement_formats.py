"""Engine-placement transfers (engine placement) on a GPU in every engine format and dtype.

The same check as ``test_gpu_server.py``, with this process doing every copy: it STOREs by copying its
blocks into objects the server reserved (RESERVE_STORE, then its store marks), then loads each width into its own
shuffled destination blocks from the pool it mapped, on its own streams. No CUDA IPC export: the server
is told a ``RegistrationArea``. Reads are enqueued right after each layer's wait, on the engine's stream,
while later slices may still be copying.
"""

from __future__ import annotations

import pytest
import torch

from kvstrata.core.engine.engine_placement import EnginePlacement
from kvstrata.core.engine.requests import ChunkLocations
from kvstrata.core.engine.slice_width import AUTO
from kvstrata.core.engine.registration_area import RegistrationArea
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.wire.client import CacheClient

from gpu_helpers import FORMAT_CASES, WIDTHS, next_instance_id, release_then_read, shuffled_blocks

TOKENS = 300  # chunk 64 on the server: four full chunks and a partial one


@pytest.mark.parametrize("fmt,dtype", FORMAT_CASES)
def test_engine_placement_widths_match_the_stored_blocks_and_chunk_major(gpu_server, fmt, dtype):
    from kvstrata.native.cuda_events import CudaEventBackend
    from kvstrata_testing.gpu_caches import GpuKVCache

    nb = -(-TOKENS // 16)
    cache = GpuKVCache(fmt, num_layers=32, num_heads=4, head_size=64, dtype=dtype,
                       num_blocks=(len(WIDTHS) + 3) * nb + 2, block_size=16)
    client = CacheClient(gpu_server.address, timeout=60.0)
    area = RegistrationArea(cache.layout, chunk_size=int(client.server_info()["chunk_size"]))
    iid = next_instance_id()
    worker = EnginePlacement(client, iid, cache.layout, event_backend=CudaEventBackend("cuda:0"),
                             local_regions=cache.region_tensors(), registration_layout=area.layout,
                             pool_writable=True)
    try:
        worker.register()
        seed = next_instance_id()
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, 32000, (TOKENS,), generator=g).tolist()
        truth = cache.random_kv(TOKENS, seed=seed)
        src = shuffled_blocks(0, nb, seed=seed)
        cache.write(truth, src)  # enqueued on the current stream: the store's copies are ordered after it
        stored = worker.store(CacheKey.for_tokens(f"store-{iid}", prompt, model=fmt), [src])
        assert stored == {"stored_tokens": TOKENS, "skipped_tokens": 0}
        cache.poison(src)  # the source is gone; only the L1 copy can fill the destinations

        per_width = {}
        for i, width in enumerate([0] + WIDTHS + [AUTO]):
            rid = f"ee-{fmt}-{dtype}-w{width}"
            key = CacheKey.for_tokens(rid, prompt, model=fmt, dtype=dtype)
            reply = client.transport.wait(client.lookup_async(key))
            assert reply["hit_tokens"] == TOKENS
            dst = shuffled_blocks((i + 1) * nb, nb, seed=100 + i)
            cache.poison(dst)
            torch.cuda.synchronize()
            # from where the LOOKUP found the chunks, as the engine runtime starts a engine-placement load
            worker.submit_retrieve(rid, key, [dst], layers_per_slice=width,
                                   located=ChunkLocations.from_lookup_reply(reply))
            _, reads = release_then_read(worker, rid, lambda layer: cache.read(dst, 0, TOKENS, [layer]),
                                         cache.num_layers)
            rec = worker.records[rid]
            assert rec.failure is None and rec.fallback is None and rec.located_by == "lookup", rec
            assert rec.auto_width == (width == AUTO) and rec.layers_per_slice >= 0
            for layer, got in enumerate(reads):
                assert got.equal(truth[:, layer:layer + 1]), f"{fmt}/{dtype} width {width}: layer {layer} differs"
            per_width[width] = reads
        for width in WIDTHS + [AUTO]:
            for layer in range(cache.num_layers):
                assert per_width[width][layer].equal(per_width[0][layer]), (width, layer)
        assert client.server_info()["l1"]["locked_objects"] == 0, "every load's locks were freed"
    finally:
        worker.close()
        client.unregister_kv_cache(iid)
        area.close()
        client.close()
