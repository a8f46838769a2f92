"""The vLLM connector's worker side on a GPU: vLLM-shaped CUDA caches, server placement by CUDA IPC.

vLLM itself is not installed on the GPU machine, so this drives the core's
WorkerRuntime with the vLLM adapter's hooks (what KvstrataConnector translates
every worker call into: the connector adds only vLLM's method names) with a cache
built the way vLLM 0.33 builds it on GPU: one int8 buffer, per-layer
``as_strided`` views of logical shape ``[blocks, kv_heads, block_size, 2*head]``
in physical order LBNHC. A real `kvstrata serve` maps it by CUDA IPC.
"""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from kvstrata.adapters.vllm import hooks as vllm_hooks
from kvstrata.adapters.vllm.kv_layout import layer_index
from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.engine.requests import LoadSpec, StoreSpec, lock_owner
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.worker_runtime import WorkerRuntime
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.store.keys import CacheKey, pack_tokens

L, NB, H, BS, HD = 32, 300, 8, 16, 128


def vllm_gpu_cache(physical: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    page = NB * H * BS * 2 * HD  # elements per layer
    buf = torch.zeros(L * page * 2, dtype=torch.int8, device="cuda")
    typed = buf.view(torch.bfloat16)
    if physical == "LBNHC":
        stride = (BS * H * 2 * HD, 2 * HD, H * 2 * HD, 1)
    else:  # LBHNC
        stride = (H * BS * 2 * HD, BS * 2 * HD, 2 * HD, 1)
    layers = {f"model.layers.{l}.self_attn.attn": torch.as_strided(typed, (NB, H, BS, 2 * HD), stride, l * page)
              for l in range(L)}
    return buf, layers


@pytest.mark.parametrize("physical", ["LBNHC", "LBHNC"])
def test_vllm_worker_runtime_stores_and_loads_through_cuda_ipc_with_early_release(gpu_server, tmp_path, physical):
    buf, layers = vllm_gpu_cache(physical)
    buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, device="cuda"))
    record = tmp_path / "record.jsonl"
    settings = RuntimeSettings.from_mapping({
        "server_address": gpu_server.address, "layers_per_slice": 1, "record_path": str(record),
        "instance_id": 40 + (physical == "LBHNC"), "placement": "server"}, where="kv_connector_extra_config")
    side = WorkerRuntime(load_adapter(vllm_hooks, check_engine=False), settings, model=f"vllm-gpu-{physical}")
    client = CacheClient(gpu_server.address)
    try:
        side.register(layers)
        assert side.connected and side.placement == "server"
        n = 128 * BS  # 2048 tokens: 256 MiB of KV across 32 layers
        tokens = [random.Random(3).randrange(1, 30000) for _ in range(n)]
        src = list(range(1, 129))
        dst = list(range(150, 278))
        random.Random(4).shuffle(dst)
        side.store([StoreSpec("s", pack_tokens(tokens), None, (tuple(src),), 0)])
        truth = {name: t[src].clone() for name, t in layers.items()}
        for t in layers.values():
            t[dst] = 0
        owner = lock_owner("r", side.instance_id)  # the runtime's loads name the scheduler's locks so
        assert client.lookup(CacheKey(owner, f"vllm-gpu-{physical}", 1, 0, pack_tokens(tokens), None)) == n
        side.start_loads([LoadSpec("r", "r", pack_tokens(tokens), None, (tuple(dst),), 0, 1)])
        deadline = time.monotonic() + 30
        while True:
            _, recving = side.poll(set())
            if recving and "r" in recving:
                break
            assert time.monotonic() < deadline, "the request was never released"
        for name in layers:  # vLLM's wait_for_layer_load before each attention layer
            side.wait_for_layer(layer_index(name))
        torch.cuda.current_stream().synchronize()
        for name, t in layers.items():
            assert torch.equal(t[dst].view(torch.int16), truth[name].view(torch.int16)), name
        side.transfers.wait_all()
        side.poll(set())
        events = [json.loads(line) for line in record.read_text().splitlines()]
        released = [e for e in events if e["event"] == "released" and e["request_id"] == "r"]
        assert released and released[0]["released_before_complete"] is True and released[0]["failure"] is None
        assert side.take_load_failures() == []
    finally:
        side.close()
        client.close()


def test_placement_auto_picks_engine_placement_transfers_for_a_gpu_cache(gpu_server):
    """``auto`` on a GPU: the engine's own copies (benchmarks/ttft.py shows them faster under its compute)."""
    _, layers = vllm_gpu_cache("LBNHC")
    settings = RuntimeSettings.from_mapping({"server_address": gpu_server.address, "instance_id": 45},
                                            where="kv_connector_extra_config")
    side = WorkerRuntime(load_adapter(vllm_hooks, check_engine=False), settings, model="vllm-gpu-auto")
    try:
        side.register(layers)
        assert side.connected and side.placement == "engine"
    finally:
        side.close()
