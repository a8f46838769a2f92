"""The engine runtime keyed by an engine's page-hash chain (SGLang's): stores and loads with no token ids.

SGLang hands its cache linker per-page SHA-256 hashes, never token ids, so a ``StoreSpec`` / ``LoadSpec``
may carry ``page_hashes`` instead of ``tokens``. Both placements are driven against a real server: the
engine placement's staged STORE builds its window keys from the hashes, and a load by hashes puts back
exactly the bytes that were stored.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pytest
from kvstrata.adapters.reference import conformance as reference
from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.adapter_api.types import HarnessSpec
from kvstrata.core.engine.requests import LoadSpec, StoreSpec, lock_owner
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.worker_runtime import WorkerRuntime
from kvstrata.core.store.keys import CacheKey

LAYERS, BLOCKS, BS = 4, 48, 16


def chain(prompt: list[int]) -> tuple[str, ...]:
    """A page-hash chain like SGLang's: page i's hash covers every token up to the end of page i."""
    out, prev = [], b""
    for start in range(0, len(prompt) - len(prompt) % BS, BS):
        prev = hashlib.sha256(prev + repr(prompt[start:start + BS]).encode()).digest()
        out.append(prev.hex())
    return tuple(out)


@pytest.mark.parametrize("placement", ["server", "engine"])
def test_a_prompt_stored_and_loaded_by_page_hashes_reads_back_its_bytes(server: Any, tmp_path: Any,
                                                                       placement: str) -> None:
    settings = RuntimeSettings(server.address, layers_per_slice=1, placement=placement,
                               instance_id=700 + (placement == "engine"), record_path=str(tmp_path / "r.jsonl"))
    cache = reference.ReferenceCache(HarnessSpec(num_layers=LAYERS, num_blocks=BLOCKS, block_size=BS))
    runtime = WorkerRuntime(load_adapter("reference"), settings, model="pages")
    try:
        runtime.register(cache.kv_caches)
        prompt = [(7 * i + len(placement)) % 997 for i in range(10 * BS)]
        hashes = chain(prompt)
        src = cache.allocate(len(prompt))
        cache.prefill(prompt, src)
        truth = [cache.read_layer(src, layer, len(prompt)) for layer in range(LAYERS)]
        runtime.store([StoreSpec(f"s-{placement}", b"", None, tuple(tuple(g) for g in src), 0, hashes, BS)])
        dst = cache.allocate(len(prompt))
        cache.clear(dst)
        rid = f"l-{placement}"
        # the scheduler side's LOOKUP, which locks the chunks for the load (the RETRIEVE releases them)
        key = CacheKey.for_page_hashes(lock_owner(rid, settings.instance_id), hashes, BS, model="pages")
        assert runtime.client.lookup(key) == len(prompt)  # the store is keyed by the hashes alone
        runtime.start_loads([LoadSpec(rid, rid, b"", None, tuple(tuple(g) for g in dst), 0, 1, hashes, BS)])
        deadline = time.monotonic() + 30
        while rid not in runtime.poll()[1]:
            assert time.monotonic() < deadline, "the load by page hashes was never released"
            time.sleep(0.001)
        for layer in range(LAYERS):
            runtime.wait_for_layer(layer)
        assert runtime.take_load_failures() == []
        assert [cache.read_layer(dst, layer, len(prompt)) for layer in range(LAYERS)] == truth
        runtime.poll([rid])
    finally:
        runtime.close()
        cache.close()
