"""A 1 GiB retrieve at Llama-3.1-8B shapes: the request goes back to the engine while its transfer is in flight.

The engine loop then waits per layer on its stream and reads every layer; all
32 must hold the stored KV. The released request must sit in the draining set
with its transfer future unresolved, a state the chunk-major path cannot reach.
"""

from __future__ import annotations

import pytest
import torch

from kvstrata.core.wire.client import CacheClient
from kvstrata.core.store.keys import CacheKey
from kvstrata.server_process import ServerProcess
from kvstrata.core.engine.engine_placement import EnginePlacement
from kvstrata.core.engine.server_placement import ServerPlacement
from kvstrata.core.engine.requests import ChunkLocations

from gpu_helpers import release_then_read, shuffled_blocks

TOKENS = 8192  # 8192 tokens x 32 layers x 2 x 8 heads x 128 x bf16 = 1 GiB
CHUNK = 256


@pytest.mark.parametrize("placement", ["server", "engine"])
def test_one_gib_retrieve_is_released_in_flight_and_every_layer_reads_correct(tmp_path, placement):
    """``server``: the server copies over CUDA IPC; ``worker``: engine-placement, stored through
    RESERVE_STORE and its store marks, and loaded from the mapped pool by this process's own copies."""
    from kvstrata.native.cuda_events import CudaEventBackend
    from kvstrata_testing.gpu_caches import GpuKVCache

    nb = TOKENS // 16
    cache = GpuKVCache("vllm-LBNHC", num_layers=32, num_heads=8, head_size=128, dtype="bfloat16",
                       num_blocks=2 * nb + 2, block_size=16)
    assert cache.layout.object_bytes(TOKENS) == 1 << 30
    # the one engine here stores a prompt of nearly the whole pool: let one connection reserve all of it
    with ServerProcess(l1_bytes=(1 << 30) + (64 << 20), chunk_size=CHUNK,
                       extra_args=["--max-reserved-fraction", "1"]) as srv:
        backend = CudaEventBackend("cuda:0")
        client = CacheClient(srv.address, timeout=120.0)
        area = None
        if placement == "engine":
            from kvstrata.core.engine.registration_area import RegistrationArea

            area = RegistrationArea(cache.layout, chunk_size=CHUNK)
            worker = EnginePlacement(client, 0, cache.layout, event_backend=backend,
                                     local_regions=cache.region_tensors(), registration_layout=area.layout,
                                     pool_writable=True)
        else:
            worker = ServerPlacement(client, 0, cache.layout, event_backend=backend)
        try:
            worker.register()
            prompt = torch.randint(0, 32000, (TOKENS,), generator=torch.Generator().manual_seed(3)).tolist()
            truth = cache.random_kv(TOKENS, seed=3)
            src = shuffled_blocks(0, nb, seed=1)
            cache.write(truth, src)
            store_key = CacheKey.for_tokens("store", prompt, model="llama")
            if placement == "engine":
                assert worker.store(store_key, [src])["stored_tokens"] == TOKENS
            else:
                assert client.store(store_key, 0, [src],
                                    event_handle=backend.store_event_handle())["stored_tokens"] == TOKENS
            dst = shuffled_blocks(nb, nb, seed=2)
            cache.poison(dst)
            key = CacheKey.for_tokens("big", prompt, model="llama", dtype="bfloat16")
            reply = client.transport.wait(client.lookup_async(key))
            assert reply["hit_tokens"] == TOKENS
            torch.cuda.synchronize()
            located = ChunkLocations.from_lookup_reply(reply) if placement == "engine" else None
            worker.submit_retrieve("big", key, [dst], layers_per_slice=1, located=located)
            state, reads = release_then_read(
                worker, "big", lambda layer: cache.read(dst, 0, TOKENS, [layer]).eq(truth[:, layer:layer + 1]).all(),
                cache.num_layers)
            rec = worker.records["big"]
            assert rec.failure is None and rec.fallback is None, rec
            assert state["draining"] and not state["transfer_ended"], \
                f"released only after the transfer finished: {state}"
            assert rec.released_before_complete
            assert [bool(ok) for ok in reads] == [True] * cache.num_layers
            assert rec.released_at - rec.submitted_at < rec.completed_at - rec.submitted_at
        finally:
            worker.close()
            if area is not None:
                area.close()
            client.close()
