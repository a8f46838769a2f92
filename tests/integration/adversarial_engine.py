"""An engine process for the adversarial tests: it takes every kind of server state, then waits to be told.

``python adversarial_engine.py ADDRESS INSTANCE SEED`` registers a reference-engine cache in server placement
(an arrival board named by a layer-major RETRIEVE) and one in engine placement,
stores a prompt, and holds: the lookup locks of a second LOOKUP and a store reservation. It prints ``ready``
and then obeys stdin, one command a line:

* ``load``: retrieve what the held LOOKUP locked, print ``ok`` if every layer reads back exact, else
  ``failed <code>: <message>`` (or ``wrong <layers>`` if it got bytes that are not the prompt's);
* ``exit``: leave without unregistering or freeing anything (the server must clean up after it).

The tests kill it (SIGKILL), stop it (SIGSTOP) or let it exit, then check what the server let go.
"""

from __future__ import annotations

import sys

from kvstrata.core.engine.engine_placement import EnginePlacement
from kvstrata.core.engine.server_placement import ServerPlacement
from kvstrata.core.engine.registration_area import RegistrationArea
from kvstrata.core.store.keys import CacheKey
from kvstrata.adapters.reference.engine import ModelShape, ReferenceEngine
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.transport import RemoteError

SHAPE = ModelShape(num_layers=8, kv_size=2, num_heads=2, head_size=16, dtype="bfloat16")
TOKENS = 128


def prompt_of(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 32000 for i in range(TOKENS)]


def main(address: str, instance: int, seed: int) -> None:
    client = CacheClient(address, timeout=20.0)
    engine = ReferenceEngine(SHAPE, num_blocks=4 * TOKENS // 16, block_size=16)
    server_side = ServerPlacement(client, instance, engine.layout, pool_slots=2)
    server_side.register()
    area = RegistrationArea(engine.layout, chunk_size=64)
    worker_side = EnginePlacement(client, instance + 1, engine.layout, local_regions=engine.regions,
                                  registration_layout=area.layout, pool_writable=True)
    worker_side.register()
    prompt = prompt_of(seed)
    blocks = engine.allocate(TOKENS)
    engine.prefill(prompt, blocks)
    client.store(CacheKey.for_tokens(f"store-{seed}", prompt, model="adversarial"), instance, [blocks])
    engine.clear(blocks)
    # a layer-major retrieve: the server maps this process's arrival board
    key = CacheKey.for_tokens(f"first-{seed}@i{instance}", prompt, model="adversarial")
    assert client.lookup(key) == TOKENS
    server_side.submit_retrieve(key.request_id, key, [blocks], layers_per_slice=1)
    server_side.wait_all(60)
    assert engine.mismatched_layers(prompt, blocks, 0, TOKENS) == []
    # what it holds from now on
    held = CacheKey.for_tokens(f"held-{seed}@i{instance}", prompt, model="adversarial")
    assert client.lookup(held) == TOKENS
    other = [(seed * 13 + i) % 32000 for i in range(TOKENS)]
    reservation = client.reserve_store(CacheKey.for_tokens(f"reserve-{seed}", other, model="adversarial"),
                                       instance + 1)
    assert reservation["objects"], reservation
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "load":
            dst = engine.allocate(TOKENS)
            engine.clear(dst)
            try:
                client.retrieve(held, instance, [dst])
            except RemoteError as exc:
                print(f"failed {exc.code}: {exc}", flush=True)
                continue
            wrong = engine.mismatched_layers(prompt, dst, 0, TOKENS)
            print("ok" if not wrong else f"wrong {wrong}", flush=True)
        elif command == "exit":
            break
    # no unregister, no lock release, no commit: the server must let it all go when the connection does


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
