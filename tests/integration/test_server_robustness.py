"""Bad input gets an error reply naming what was wrong, and the server keeps serving."""

import os
import random
import socket

import pytest

from kvstrata.core.wire.protocol import DECLARATIONS, RequestType
from kvstrata.server_process import ServerProcess
from kvstrata.core.wire.transport import Client, RemoteError

from helpers import send_raw, submit_unchecked


@pytest.fixture(scope="module")
def server(inprocess_server):
    """These protocol tests run against an in-process server (tests/conftest.py): no process to start."""
    return inprocess_server


GOOD = {
    RequestType.PING: [],
    RequestType.SERVER_INFO: [],
    RequestType.REGISTER_KV_CACHE: [0, {"format": "blocks", "placement": "server", "num_layers": 1, "kv_size": 2}],
    RequestType.UNREGISTER_KV_CACHE: [0],
    RequestType.LOOKUP: [{"request_id": "r", "model": "m", "world_size": 1, "rank": 0, "salt": None, "tokens": b""}],
    RequestType.STORE: [{"request_id": "r", "model": "m", "world_size": 1, "rank": 0, "salt": None, "tokens": b""},
                        0, [[0]], None, 0],
    RequestType.RETRIEVE: [{"request_id": "r", "model": "m", "world_size": 1, "rank": 0, "salt": None,
                            "tokens": b""}, 0, [[0]], None, 0, None, None, 0],
    RequestType.FREE_LOOKUP_LOCKS: ["r"],
    RequestType.RESERVE_STORE: [{"request_id": "r", "model": "m", "world_size": 1, "rank": 0, "salt": None,
                                 "tokens": b""}, 0, 0],
    RequestType.COMMIT_STORE: [0, True],
}


def test_every_declaration_has_a_sample():
    assert set(GOOD) == set(DECLARATIONS)


def _wrong_types(payload):
    # Replace every item with a value of a type no declaration accepts for it.
    return [3.5 for _ in payload]


@pytest.mark.parametrize("rt", list(RequestType), ids=lambda r: r.name)
def test_short_long_and_mistyped_payloads_get_error_replies(server, rt):
    c = Client(server.address, default_timeout=10)
    try:
        good = GOOD[rt]
        cases = {"one item long": good + [0]}
        if good:
            cases["one item short"] = good[:-1]
            cases["wrong types"] = _wrong_types(good)
        for label, payload in cases.items():
            with pytest.raises(RemoteError) as info:
                c.wait(submit_unchecked(c, rt, payload))
            assert rt.name in str(info.value), (label, str(info.value))
            assert c.call(RequestType.PING) == "pong", label
    finally:
        c.close()


def test_garbage_frames_and_random_bytes_do_not_take_the_server_down(server):
    c = Client(server.address, default_timeout=10)
    rng = random.Random(1234)
    try:
        # valid ZMQ framing, garbage contents
        for n in (0, 1, 7, 64, 4096):
            send_raw(c, bytes(rng.getrandbits(8) for _ in range(n)))
        send_raw(c, b"\x94\x01\x05\x05\x90")  # [1, 5, RETRIEVE, []]: a short RETRIEVE with a valid header
        assert c.call(RequestType.PING) == "pong"
        # a payload that is not a list
        with pytest.raises(RemoteError, match="LOOKUP"):
            c.wait(submit_unchecked(c, RequestType.LOOKUP, {"not": "a list"}))
        assert c.call(RequestType.PING) == "pong"
    finally:
        c.close()


def test_raw_tcp_noise_does_not_take_the_server_down(curve_keys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with ServerProcess(address=f"tcp://127.0.0.1:{port}", l1_bytes=8 << 20, extra_args=curve_keys.serve_args,
                       client_options=curve_keys.client_options) as srv:
        rng = random.Random(99)
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                try:
                    raw.sendall(bytes(rng.getrandbits(8) for _ in range(2048)))
                except OSError:
                    pass  # the server may hang up on a bad greeting: that is fine
        c = Client(srv.address, default_timeout=10, **curve_keys.client_options)
        try:
            assert c.call(RequestType.PING) == "pong"
        finally:
            c.close()


def test_refuses_non_loopback_bind_by_default():
    from kvstrata.core.wire.transport import check_bind_address

    with pytest.raises(ValueError, match="only loopback"):
        check_bind_address("tcp://0.0.0.0:5555")
    check_bind_address("tcp://0.0.0.0:5555", allow_remote=True, curve=True)


def test_ipc_socket_and_pool_are_private_to_the_user(server):
    path = server.address[len("ipc://"):]
    assert os.stat(path).st_mode & 0o077 == 0
    assert os.stat(os.path.dirname(path)).st_mode & 0o077 == 0
    c = Client(server.address, default_timeout=10)
    try:
        info = c.call(RequestType.SERVER_INFO)
    finally:
        c.close()
    assert os.stat(f"/dev/shm/{info['pool']['name']}").st_mode & 0o077 == 0
