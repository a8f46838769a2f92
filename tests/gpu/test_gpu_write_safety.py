"""On a GPU: a CUDA IPC descriptor that claims more than its allocation, and block ids past the cache's end,
are refused; a GPU retrieve after rejected requests is byte-exact."""

from __future__ import annotations

import pytest
import torch

from kvstrata.core.wire.client import CacheClient
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.transfer.layouts import Region, blocks_layout
from kvstrata.core.wire.transport import RemoteError
from kvstrata.core.engine.server_placement import ServerPlacement

from gpu_helpers import next_instance_id, release_then_read, shuffled_blocks

TOKENS = 256


def test_a_cuda_region_larger_than_its_allocation_is_refused(gpu_server):
    from kvstrata.native.cuda_ipc import export_region

    backing = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda:0")
    region = export_region(backing)
    # past the end of the allocation the caching allocator carved it from (which earlier tests may have grown
    # well beyond the tensor): claimed in whole blocks of the layout below
    ptr, block_bytes = backing.data_ptr(), 4 * 16 * 2 * 64 * 2
    segment = next(s for s in torch.cuda.memory_snapshot() if s["address"] <= ptr < s["address"] + s["total_size"])
    claimed = ((segment["address"] + segment["total_size"] - ptr) // block_bytes + 64) * block_bytes
    lying = Region("cuda_ipc", claimed, handle={**region.handle, "storage_size": claimed + 4096})
    layout = blocks_layout(num_layers=2, kv_size=2, num_blocks=claimed // (4 * 16 * 2 * 64 * 2), block_size=16,
                           num_heads=2, head_size=64, dtype="bfloat16", region=lying)
    client = CacheClient(gpu_server.address, timeout=60.0)
    try:
        with pytest.raises(RemoteError, match="the allocation the handle opened holds only"):
            client.register_kv_cache(next_instance_id(), layout, "server")
        assert torch.count_nonzero(backing).item() == 0
    finally:
        client.close()


def test_a_gpu_retrieve_after_rejected_requests_is_byte_exact(gpu_server):
    from kvstrata.core.arrival.board import ArrivalBoard
    from kvstrata.native.cuda_events import CudaEventBackend
    from kvstrata_testing.gpu_caches import GpuKVCache

    nb = TOKENS // 16
    cache = GpuKVCache("vllm-LBNHC", num_layers=32, num_heads=4, head_size=64, dtype="bfloat16",
                       num_blocks=3 * nb + 2, block_size=16)
    backend = CudaEventBackend("cuda:0")
    client = CacheClient(gpu_server.address, timeout=60.0)
    iid = next_instance_id()
    worker = ServerPlacement(client, iid, cache.layout, event_backend=backend)
    board = ArrivalBoard.create(1)
    try:
        worker.register()
        prompt = torch.randint(0, 32000, (TOKENS,), generator=torch.Generator().manual_seed(iid)).tolist()
        truth = cache.random_kv(TOKENS, seed=iid)
        src = shuffled_blocks(0, nb, seed=iid)
        cache.write(truth, src)
        client.store(CacheKey.for_tokens(f"store-{iid}", prompt, model="g"), iid, [src],
                     event_handle=backend.store_event_handle())
        cache.poison(src)
        dst = shuffled_blocks(nb, nb, seed=iid + 1)
        torch.cuda.synchronize()
        before = [t.clone() for t in cache.region_tensors()]
        pool = client.server_info()["pool"]["name"]
        rejected = [
            dict(block_ids=[[*dst[:-1], cache.layout.num_blocks]]),  # one block id past the end
            dict(block_ids=[dst], arrival_board={"name": pool, "slot": 0, "generation": 1}, layers_per_slice=1),
            dict(block_ids=[dst], arrival_board={"name": board.name, "slot": 1, "generation": 1}, layers_per_slice=1),
            dict(block_ids=[dst], skip_first_n_tokens=TOKENS + 1),
        ]
        for i, kw in enumerate(rejected):
            key = CacheKey.for_tokens(f"bad-{iid}-{i}", prompt, model="g", dtype="bfloat16")
            assert client.lookup(key) == TOKENS
            blocks = kw.pop("block_ids")
            with pytest.raises(RemoteError):
                client.retrieve(key, iid, blocks, **kw)
            client.free_lookup_locks(f"bad-{iid}-{i}")
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(before, cache.region_tensors())), "a rejected request wrote"
        assert bytes(board.segment.buf[64:]) == bytes(64)
        key = CacheKey.for_tokens(f"good-{iid}", prompt, model="g", dtype="bfloat16")
        assert client.lookup(key) == TOKENS
        worker.submit_retrieve(f"good-{iid}", key, [dst], layers_per_slice=1)
        release_then_read(worker, f"good-{iid}", lambda layer: None, 32)
        assert torch.equal(cache.read(dst, 0, TOKENS), truth), "the GPU retrieve after rejected requests differs"
    finally:
        board.destroy()
        worker.close()
        client.close()
