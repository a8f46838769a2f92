"""The vLLM connector's worker side on a GPU: vLLM-shaped CUDA caches, server placement by CUDA IPC.

vLLM itself is not installed on the GPU machine, so this drives the adapter's
WorkerSide (what KvstrataConnector delegates every worker call to) with a cache
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

from kvstrata.adapters.vllm.settings import ConnectorSettings
from kvstrata.adapters.vllm.worker_side import WorkerSide
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
def test_vllm_worker_side_stores_and_loads_through_cuda_ipc_with_early_release(gpu_server, tmp_path, physical):
    buf, layers = vllm_gpu_cache(physical)
    buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, device="cuda"))
    record = tmp_path / "record.jsonl"
    settings = ConnectorSettings.from_extra_config({
        "server_address": gpu_server.address, "layers_per_stage": 1, "record_path": str(record),
        "instance_id": 40 + (physical == "LBHNC")})
    side = WorkerSide(settings, model=f"vllm-gpu-{physical}", block_size=BS)
    client = CacheClient(gpu_server.address)
    try:
        side.register(layers)
        assert side.worker is not None and side.worker.placement == "server"
        n = 128 * BS  # 2048 tokens: 256 MiB of KV across 32 layers
        tokens = [random.Random(3).randrange(1, 30000) for _ in range(n)]
        src = list(range(1, 129))
        dst = list(range(150, 278))
        random.Random(4).shuffle(dst)
        side.store([{"request_id": "s", "tokens": pack_tokens(tokens), "salt": None, "block_ids": src, "skip": 0}])
        truth = {name: t[src].clone() for name, t in layers.items()}
        for t in layers.values():
            t[dst] = 0
        assert client.lookup(CacheKey("r", f"vllm-gpu-{physical}", 1, 0, pack_tokens(tokens), None)) == n
        side.start_loads([{"request_id": "r", "tokens": pack_tokens(tokens), "salt": None, "block_ids": [dst],
                           "skip": 0, "layers_per_stage": 1}])
        deadline = time.monotonic() + 30
        while True:
            _, recving = side.get_finished(set())
            if recving and "r" in recving:
                break
            assert time.monotonic() < deadline, "the request was never released"
        for name in layers:  # vLLM's wait_for_layer_load before each attention layer
            side.wait_for_layer(name)
        torch.cuda.current_stream().synchronize()
        for name, t in layers.items():
            assert torch.equal(t[dst].view(torch.int16), truth[name].view(torch.int16)), name
        side.worker.wait_all()
        side.get_finished(set())
        events = [json.loads(line) for line in record.read_text().splitlines()]
        released = [e for e in events if e["event"] == "released" and e["request_id"] == "r"]
        assert released and released[0]["released_before_complete"] is True and released[0]["failure"] is None
        assert side.take_load_errors() == set()
    finally:
        side.close()
        client.close()
