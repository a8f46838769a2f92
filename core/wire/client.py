"""Typed calls over the transport: what engine-side code uses to talk to the cache server."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Sequence

from kvstrata.core.shm import proof_of
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.transfer.block_table import BlockTable
from kvstrata.core.transfer.layouts import PagedKVLayout
from kvstrata.core.wire.protocol import RequestType, chunk_major_retrieve_tail
from kvstrata.core.wire.transport import Client


def build_retrieve_payload(key: CacheKey, instance_id: int, block_ids: Sequence[Sequence[int]], *,
                           skip_first_n_tokens: int = 0, event_handle: bytes | None = None,
                           arrival_board: dict[str, Any] | None = None,
                           layer_event_handles: list[bytes] | None = None, layers_per_slice: int = 0) -> list[Any]:
    """The eight RETRIEVE items, in declaration order; ``(None, None, 0)`` as the tail when chunk-major.

    One builder for every sender: :meth:`CacheClient.retrieve_async` and the
    adapters' ``kvstrata_build_retrieve_payload`` hook both call it, so the
    payload shape cannot drift between the core and an adapter.
    """
    if layers_per_slice == 0 and arrival_board is None and layer_event_handles is None:
        tail = list(chunk_major_retrieve_tail())
    else:
        tail = [arrival_board, layer_event_handles, layers_per_slice]
    return [key.to_wire(), instance_id, BlockTable(block_ids), event_handle, skip_first_n_tokens, *tail]


class CacheClient:
    def __init__(self, address: str, *, timeout: float = 30.0,
                 curve_server_key: str | None = None, curve_client_key: str | None = None) -> None:
        """``curve_server_key`` (the
        server's public ``NAME.key`` file) and ``curve_client_key`` (this client's ``NAME.key_secret`` file):
        connect with CURVE, as a server on tcp:// requires (see :mod:`kvstrata.core.wire.curve`)."""
        self.transport = Client(address, default_timeout=timeout, curve_server_key=curve_server_key,
                                curve_client_key=curve_client_key)

    @property
    def address(self) -> str:
        return self.transport.address

    def ping(self, timeout: float | None = None) -> str:
        return self.transport.call(RequestType.PING, [], timeout)

    def server_info(self) -> dict[str, Any]:
        return self.transport.call(RequestType.SERVER_INFO, [])

    def register_kv_cache(self, instance_id: int, layout: PagedKVLayout, placement: str) -> dict[str, Any]:
        descriptor = layout.to_wire(placement)
        for region in descriptor["regions"]:
            proof = proof_of(region.get("name", "")) if region.get("kind") == "shm" else None
            if proof is not None:  # this process made the segment: prove it to the server
                region["handle"] = {**(region.get("handle") or {}), "proof": proof}
        return self.transport.call(RequestType.REGISTER_KV_CACHE, [instance_id, descriptor])

    def unregister_kv_cache(self, instance_id: int) -> bool:
        return self.transport.call(RequestType.UNREGISTER_KV_CACHE, [instance_id])

    def lookup_async(self, key: CacheKey) -> Future:
        return self.transport.submit(RequestType.LOOKUP, [key.to_wire()])

    def lookup(self, key: CacheKey) -> int:
        """Hit length in tokens; the hit chunks stay locked for key.request_id."""
        return self.transport.wait(self.lookup_async(key))["hit_tokens"]

    def store_async(self, key: CacheKey, instance_id: int, block_ids: Sequence[Sequence[int]],
                    skip_first_n_tokens: int = 0, event_handle: bytes | None = None) -> Future:
        return self.transport.submit(
            RequestType.STORE,
            [key.to_wire(), instance_id, BlockTable(block_ids), event_handle, skip_first_n_tokens],
            validate=False,  # built here from typed values; the server validates
        )

    def store(self, key: CacheKey, instance_id: int, block_ids: Sequence[Sequence[int]],
              skip_first_n_tokens: int = 0, event_handle: bytes | None = None) -> dict[str, Any]:
        return self.transport.wait(self.store_async(key, instance_id, block_ids, skip_first_n_tokens, event_handle))

    def reserve_store(self, key: CacheKey, instance_id: int, skip_first_n_tokens: int = 0) -> dict[str, Any]:
        """Engine placement: reserve L1 objects for ``key``'s chunks not stored yet (see RESERVE_STORE)."""
        return self.transport.wait(self.reserve_store_async(key, instance_id, skip_first_n_tokens))

    def reserve_store_async(self, key: CacheKey, instance_id: int, skip_first_n_tokens: int = 0) -> Future:
        """Send RESERVE_STORE and return at once: the future holds the reservation (or the error reply)."""
        return self.transport.submit(RequestType.RESERVE_STORE, [key.to_wire(), instance_id, skip_first_n_tokens])

    def commit_store(self, reservation: int, landed: bool) -> dict[str, Any]:
        """Engine placement: commit a reservation whose copies landed, or drop one whose copies failed."""
        return self.transport.wait(self.transport.submit(RequestType.COMMIT_STORE, [reservation, landed]))

    def retrieve_async(self, key: CacheKey, instance_id: int, block_ids: Sequence[Sequence[int]], *,
                       skip_first_n_tokens: int = 0, event_handle: bytes | None = None,
                       arrival_board: dict[str, Any] | None = None, layer_event_handles: list[bytes] | None = None,
                       layers_per_slice: int = 0) -> Future:
        """Send RETRIEVE: always eight items, ``(None, None, 0)`` as the tail when chunk-major."""
        payload = build_retrieve_payload(
            key, instance_id, block_ids, skip_first_n_tokens=skip_first_n_tokens, event_handle=event_handle,
            arrival_board=arrival_board, layer_event_handles=layer_event_handles, layers_per_slice=layers_per_slice)
        # as for STORE
        return self.transport.submit(RequestType.RETRIEVE, payload, validate=False)

    def retrieve(self, key: CacheKey, instance_id: int, block_ids: Sequence[Sequence[int]],
                 **kw: Any) -> dict[str, Any]:
        return self.transport.wait(self.retrieve_async(key, instance_id, block_ids, **kw))

    def free_lookup_locks(self, request_id: str) -> int:
        return self.transport.call(RequestType.FREE_LOOKUP_LOCKS, [request_id])

    def close(self) -> None:
        self.transport.close()
