"""On a GPU, an engine-placement load whose lookup locks are lost fails: it never hands the engine other bytes.

The scheduler's connection, whose LOOKUP took the locks, goes away while the load is held after its first
slice (the server ends that connection and frees what it held, as a lease would); another engine then evicts
and reuses the load's chunks. Once the load goes on, its copies read what now lies at those offsets; the
generation check after its copies ends the load as failed, and the engine gets its blocks back for recompute.
"""

from __future__ import annotations

import random
import time

import torch

from kvstrata.adapters.vllm import hooks as vllm_hooks
from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.engine.requests import ChunkLocations, LoadSpec, StoreSpec, lock_owner
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.worker_runtime import WorkerRuntime
from kvstrata.core.store.keys import CacheKey, pack_tokens
from kvstrata.adapters.reference.engine import ModelShape, ReferenceEngine
from kvstrata.server_process import ServerProcess
from kvstrata.conformance_tests.slice_hold import SliceHold
from kvstrata.core.wire.client import CacheClient

from test_gpu_engine_placement import wait_released
from test_gpu_vllm_worker import BS, vllm_gpu_cache

N_BLOCKS = 64  # 1024 tokens: 128 MiB of this cache's KV
TOKEN_BYTES = 32 * 8 * 2 * 128 * 2
FLOOD_SHAPE = ModelShape(num_layers=32, kv_size=2, num_heads=8, head_size=128, dtype="bfloat16")


def locked_objects(address: str) -> int:
    probe = CacheClient(address)
    try:
        return probe.server_info()["l1"]["locked_objects"]
    finally:
        probe.close()


def test_a_load_whose_chunks_are_evicted_under_it_fails_and_its_blocks_are_recomputed(tmp_path, caplog) -> None:
    tokens = N_BLOCKS * BS
    with ServerProcess(l1_bytes=5 * tokens * TOKEN_BYTES // 2, chunk_size=64) as srv:  # room for two prompts
        buf, layers = vllm_gpu_cache("LBNHC")
        buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, device="cuda"))
        settings = RuntimeSettings.from_mapping({
            "server_address": srv.address, "layers_per_slice": 1, "instance_id": 70, "placement": "engine"},
            where="kv_connector_extra_config")
        side = WorkerRuntime(load_adapter(vllm_hooks, check_engine=False), settings, model="vllm-gpu-lost")
        flood = ReferenceEngine(FLOOD_SHAPE, num_blocks=N_BLOCKS, block_size=BS)
        flooder = CacheClient(srv.address, timeout=60.0)
        hold = SliceHold(tmp_path / "hold")
        hold.hold("lost", after_slices=1)
        try:
            side.register(layers)
            prompt = [random.Random(9).randrange(1, 30000) for _ in range(tokens)]
            side.store([StoreSpec("s", pack_tokens(prompt), None, (tuple(range(1, 1 + N_BLOCKS)),), 0)])
            scheduler = CacheClient(srv.address)
            key = CacheKey(lock_owner("lost", side.instance_id), side.model, 1, 0, pack_tokens(prompt), None)
            reply = scheduler.transport.wait(scheduler.lookup_async(key))
            assert reply["hit_tokens"] == tokens
            dst = list(range(100, 100 + N_BLOCKS))
            with hold.installed():
                side.start_loads([LoadSpec("lost", "lost", pack_tokens(prompt), None, (tuple(dst),), 0, 1,
                                           located=(ChunkLocations.from_lookup_reply(reply),))])
                hold.wait_held("lost", 30)
                wait_released(side, "lost")
                scheduler.close()  # the locks' holder goes: the server frees them
                deadline = time.monotonic() + 30
                while locked_objects(srv.address):
                    assert time.monotonic() < deadline, "the gone connection's locks were never freed"
                    time.sleep(0.05)
                flooder.register_kv_cache(71, flood.layout, "server")
                blocks = flood.allocate(tokens)
                for i in range(3):  # evicts and reuses the load's chunks
                    other = [random.Random(100 + i).randrange(1, 30000) for _ in range(tokens)]
                    flood.prefill(other, blocks)
                    stored = flooder.store(CacheKey.for_tokens(f"flood-{i}", other, model="flood"), 71, [blocks])
                    assert stored["stored_tokens"] == tokens
                hold.open("lost")
                failures: list = []
                deadline = time.monotonic() + 60
                while not failures and time.monotonic() < deadline:
                    side.poll(set())
                    failures = side.take_load_failures()
                    time.sleep(0.001)
                assert failures == [set(dst)], "the load failed and its blocks go back for recompute"
            assert any("lost" in r.getMessage() and "evicted while it copied" in r.getMessage()
                       for r in caplog.records), "the failure names its cause"
        finally:
            hold.open_all()
            flooder.close()
            side.close()
            flood.close()
