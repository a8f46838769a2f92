"""Test support for the SGLang engine tests: SGLang's page hashes, and the control that alters stored KV.

The control must prove the equality checks can fail: it changes the bytes of exactly one layer of what
kvstrata stored for a prompt, in the server's own L1 pool, so a later load of that prompt reads altered KV
for that layer only. It finds the objects the way a engine-placement engine does: it registers a small
engine-placement instance with the same shape, LOOKUPs the prompt by SGLang's page-hash chain and sends a
RETRIEVE, whose reply says where each chunk lies in the pool; then it maps the pool (writable: this is the
test, not an engine) and negates that layer's K and V there. Nothing is copied into an engine.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from kvstrata.core.shm import Segment, create_cache_segment
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.transfer.layouts import PLACEMENT_ENGINE, Region, blocks_layout, blocks_layout_bytes
from kvstrata.core.wire.client import CacheClient

_instances = itertools.count(900)


def sglang_page_hashes(tokens: list[int], page_size: int) -> list[str]:
    """SGLang's storage page-hash chain for a prompt with no extra key or cache salt (as its linker gets)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    whole = len(tokens) // page_size * page_size
    return list(get_storage_hash_str(tokens[:whole], None, page_size=page_size))


def corrupt_stored_layer(*, server_address: str, model: str, tokens: list[int], page_size: int, layer: int,
                         num_layers: int, num_heads: int, head_size: int, dtype: str = "float32") -> dict[str, Any]:
    """Negate ``layer``'s stored K and V for every whole page of ``tokens``; returns what was altered."""
    hashes = sglang_page_hashes(tokens, page_size)
    pages = len(hashes)
    instance = next(_instances)
    # a engine-placement engine registers a shared-memory staging area of its cache's shape: so does this (made
    # as an engine's, with the proof of ownership the server asks of whoever registers a segment)
    geometry = {"num_layers": num_layers, "kv_size": 2, "num_blocks": pages + 1, "block_size": page_size,
                "num_heads": num_heads, "head_size": head_size, "dtype": dtype}
    size = blocks_layout_bytes(**geometry)
    staging = create_cache_segment("test-corrupt", size)
    layout = blocks_layout(**geometry, region=Region("shm", size, staging.name))
    client = CacheClient(server_address, timeout=30.0)
    rid = f"test-corrupt-{instance}"
    try:
        reply = client.register_kv_cache(instance, layout, PLACEMENT_ENGINE)
        key = CacheKey.for_page_hashes(rid, hashes, page_size, model=model)
        hit = client.lookup(key)
        if hit != pages * page_size:
            raise AssertionError(f"the server holds {hit} of the prompt's {pages * page_size} tokens")
        objects = client.retrieve(key, instance, [list(range(1, pages + 1))])["objects"]
        pool = reply["pool"]
        seg = Segment.attach(pool["name"], int(pool["size"]))
        try:
            data = torch.frombuffer(seg.buf, dtype=torch.float32, count=seg.size // 4)
            altered = 0
            for offset, nbytes, num_tokens, *_ in objects:  # then the object's generation-table slot and word
                view = data[offset // 4:(offset + nbytes) // 4].view(2, num_layers, num_tokens, num_heads, head_size)
                view[:, layer].neg_()
                altered += num_tokens
        finally:
            del data
            seg.close()
        return {"layer": layer, "tokens": altered, "chunks": len(objects)}
    finally:
        try:
            client.free_lookup_locks(rid)
            client.unregister_kv_cache(instance)
        finally:
            client.close()
            staging.destroy()


def wait_stored(*, server_address: str, model: str, tokens: list[int], page_size: int,
                timeout: float = 120.0) -> dict[str, Any]:
    """Block until the server holds every whole page of ``tokens``, each under its one-page key (how the
    HiCache backend stores): HiCache backs pages up to storage on its own thread, and a check that needs
    them stored must not depend on how soon that thread gets to them. Bounded: only catches a hang."""
    import time

    hashes = sglang_page_hashes(tokens, page_size)
    client = CacheClient(server_address, timeout=10.0)
    owner = f"test-wait-stored-{next(_instances)}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            held = sum(client.lookup(CacheKey.for_page_hashes(owner, [h], page_size, model=model)) > 0
                       for h in hashes)
            client.free_lookup_locks(owner)
            if held == len(hashes):
                return {"pages": held}
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server holds {held} of the prompt's {len(hashes)} pages after {timeout:.0f}s")
            time.sleep(0.05)
    finally:
        client.close()
