"""Protocol declarations, handler-signature checks and the codec's refusal of anything but plain values."""

import msgpack
import pytest

from kvstrata.core.wire import codec
from kvstrata.core.wire.protocol import (
    DECLARATIONS, RETRIEVE_ITEMS, ProtocolError, RequestType, check_handler_signature,
)
from kvstrata.core.server.cache_server import CacheServer, ServerConfig
from kvstrata.core.wire.transport import Server


def validate_payload(request_type: RequestType, payload: list) -> None:
    DECLARATIONS[request_type].validate(payload)


def test_every_request_type_is_declared():
    assert set(DECLARATIONS) == set(RequestType)
    for name in ("REGISTER_KV_CACHE", "UNREGISTER_KV_CACHE", "LOOKUP", "STORE", "RETRIEVE",
                 "FREE_LOOKUP_LOCKS", "PING"):
        assert RequestType[name] in DECLARATIONS


def test_retrieve_is_eight_items_in_the_specified_order():
    assert [i.name for i in RETRIEVE_ITEMS] == [
        "key", "instance_id", "block_ids", "event_handle", "skip_first_n_tokens",
        "arrival_board", "layer_event_handles", "layers_per_slice"]


def test_wrong_arity_handler_fails_registration_naming_retrieve(tmp_path):
    srv = Server(f"ipc://{tmp_path}/s.sock")

    def five_arg_retrieve(key, instance_id, block_ids, event_handle, skip):
        return {}

    with pytest.raises(ProtocolError) as info:
        srv.register(RequestType.RETRIEVE, five_arg_retrieve)
    msg = str(info.value)
    assert "RETRIEVE" in msg and "expects 5 arguments" in msg and "declares 8" in msg


def test_a_handler_with_the_right_count_but_other_names_fails_registration(tmp_path):
    srv = Server(f"ipc://{tmp_path}/s.sock")

    def swapped(key, block_ids, instance_id, event_handle, skip_first_n_tokens):  # two items swapped
        return {}

    with pytest.raises(ProtocolError) as info:
        srv.register(RequestType.STORE, swapped)
    msg = str(info.value)
    assert "STORE" in msg and "(key, block_ids, instance_id" in msg and "(key, instance_id, block_ids" in msg


def test_server_handlers_all_match_their_declarations(tmp_path):
    server = CacheServer(ServerConfig(address=f"ipc://{tmp_path}/s.sock", l1_bytes=1 << 20))
    try:
        for rt, decl in DECLARATIONS.items():
            check_handler_signature(rt, server.transport._handlers[rt])
    finally:
        server.store.close()


def test_start_refuses_missing_handlers(tmp_path):
    srv = Server(f"ipc://{tmp_path}/s.sock")
    srv.register(RequestType.PING, lambda: "pong")
    with pytest.raises(ProtocolError, match="no handler registered for .*RETRIEVE"):
        srv.start()


def test_validate_names_the_item_and_types():
    with pytest.raises(ProtocolError, match=r"FREE_LOOKUP_LOCKS: item 0 \(request_id\) must be str, got int"):
        validate_payload(RequestType.FREE_LOOKUP_LOCKS, [3])
    with pytest.raises(ProtocolError, match=r"RETRIEVE: payload has 5 items, the protocol declares 8"):
        validate_payload(RequestType.RETRIEVE, [None] * 5)
    with pytest.raises(ProtocolError, match=r"item 2 \(block_ids\) must be list\[list\[int >= 0\]\]"):
        key = {"request_id": "r", "model": "m", "world_size": 1, "rank": 0, "salt": None, "tokens": b""}
        validate_payload(RequestType.RETRIEVE, [key, 0, [["a"]], None, 0, None, None, 0])


def test_bool_is_not_an_int():
    with pytest.raises(ProtocolError):
        validate_payload(RequestType.UNREGISTER_KV_CACHE, [True])


def test_codec_round_trip_and_refuses_extension_types():
    frame = codec.encode_request(7, RequestType.PING, [])
    req = codec.decode_request(frame)
    assert (req.request_id, req.request_type, req.payload) == (7, RequestType.PING, [])
    # An extension type (the msgpack way to smuggle objects) is rejected, never interpreted.
    evil = msgpack.packb([1, 9, 0, [msgpack.ExtType(42, b"\x80\x04pickle")]], use_bin_type=True)
    with pytest.raises(codec.DecodeError, match="extension type 42"):
        codec.decode_request(evil)
    with pytest.raises(codec.DecodeError, match="unknown request type"):
        codec.decode_request(msgpack.packb([1, 1, 99, []]))
    with pytest.raises(codec.DecodeError, match="wire version"):
        codec.decode_request(msgpack.packb([2, 1, 0, []]))
    with pytest.raises(codec.DecodeError):
        codec.decode_request(b"\xc1\xff\x00garbage")


def test_a_cache_key_by_page_hashes_is_declared_and_checked():
    from kvstrata.core.store.keys import CacheKey

    key = CacheKey.for_page_hashes("r", ["a", "b"], 16, model="m").to_wire()
    validate_payload(RequestType.LOOKUP, [key])
    for bad in ({**key, "page_hashes": [1, 2]}, {**key, "page_size": -1}, {**key, "page_hashes": "ab"}):
        with pytest.raises(ProtocolError, match="key"):
            validate_payload(RequestType.LOOKUP, [bad])
