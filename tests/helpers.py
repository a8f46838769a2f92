"""Shared test plumbing: an engine registered with a server, a prompt stored, the engine loop."""

from __future__ import annotations

import torch

from kvstrata.core.client import CacheClient
from kvstrata.core.keys import CacheKey
from kvstrata.core.testing.reference_engine import ModelShape, ReferenceEngine
from kvstrata.core.worker import LayerwiseWorker

SMALL_32 = ModelShape(num_layers=32, kv_size=2, num_heads=2, head_size=16, dtype="bfloat16")


def store_prompt(client: CacheClient, engine: ReferenceEngine, prompt: list[int], instance_id: int = 0) -> None:
    blocks = engine.allocate(len(prompt))
    engine.prefill(prompt, blocks)
    client.store(CacheKey.for_tokens("store", prompt, model="m"), instance_id, [blocks])
    engine.clear(blocks)
    engine.free(blocks)


def lookup_into_fresh_blocks(client: CacheClient, engine: ReferenceEngine, request_id: str,
                             prompt: list[int]) -> tuple[CacheKey, list[int]]:
    """What precedes a retrieve: LOOKUP the whole prompt (it must hit), then allocate and poison its destination."""
    key = CacheKey.for_tokens(request_id, prompt, model="m")
    assert client.lookup(key) == len(prompt)
    dst = engine.allocate(len(prompt))
    engine.clear(dst)
    return key, dst


def engine_loop(worker: LayerwiseWorker, request_id: str, num_layers: int, timeout: float = 30.0) -> dict:
    """What an engine does: poll get_finished until released, then wait before reading each layer.

    Returns what was true at the moment of release (transfer still running? in the draining set?).
    """
    import time

    deadline = time.monotonic() + timeout
    seen = {}
    while request_id not in seen:
        for r in worker.get_finished():
            fut = worker.future_of(r)
            seen[r] = {"future_done": fut.done() if fut is not None else True,
                       "draining": r in worker.draining()}
        if time.monotonic() > deadline:
            raise TimeoutError(f"{request_id} was never released")
    for layer in range(num_layers):
        worker.wait_for_layer(layer)
    worker.wait_all()
    return seen[request_id]


def random_prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n,), generator=g).tolist()
