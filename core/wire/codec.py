"""Encode and decode wire messages with msgpack only.

A frame is one msgpack array. Requests: ``[WIRE_VERSION, request_id, request_type, payload]``.
Replies: ``[request_id, ok, value]`` where ``value`` is the handler's result when
``ok`` is true and an error string otherwise. Nothing from the wire is ever
unpickled; msgpack is configured to refuse extension types, so bytes from a
hostile peer decode to plain values or raise :class:`DecodeError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from kvstrata.core.wire.protocol import RequestType

WIRE_VERSION = 1
MAX_FRAME_BYTES = 256 * 1024 * 1024


class DecodeError(ValueError):
    """A frame could not be decoded into a request or a reply."""


@dataclass(frozen=True)
class Request:
    request_id: int
    request_type: RequestType
    payload: list[Any]


@dataclass(frozen=True)
class Reply:
    request_id: int
    ok: bool
    value: Any


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(frame: bytes) -> Any:
    if len(frame) > MAX_FRAME_BYTES:
        raise DecodeError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
        )
    except DecodeError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise DecodeError(f"undecodable frame ({type(exc).__name__}: {exc})") from None


def _refuse_ext(code: int, data: bytes) -> Any:
    raise DecodeError(f"msgpack extension type {code} is not accepted")


def encode_request(request_id: int, request_type: RequestType, payload: list[Any] | tuple[Any, ...]) -> bytes:
    return _pack([WIRE_VERSION, request_id, int(request_type), list(payload)])


def decode_request(frame: bytes) -> Request:
    """Decode a request frame; the payload's contents are checked by the protocol, not here."""
    msg = _unpack(frame)
    if not isinstance(msg, list) or len(msg) != 4:
        raise DecodeError("a request must be a 4-item array [version, request_id, request_type, payload]")
    version, request_id, code, payload = msg
    if version != WIRE_VERSION:
        raise DecodeError(f"wire version {version!r} is not supported (this side speaks {WIRE_VERSION})")
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise DecodeError(f"request_id must be an int, got {type(request_id).__name__}")
    try:
        request_type = RequestType(code)
    except (ValueError, TypeError):
        raise DecodeError(f"unknown request type code {code!r}") from None
    if not isinstance(payload, list):
        raise DecodeError(f"{request_type.name}: payload must be an array, got {type(payload).__name__}")
    return Request(request_id, request_type, payload)


def peek_request_id(frame: bytes) -> int | None:
    """Best-effort request id of a frame that failed to decode, so the error reply can be routed."""
    try:
        msg = _unpack(frame)
        rid = msg[1]
        return rid if isinstance(rid, int) and not isinstance(rid, bool) else None
    except Exception:
        return None


def encode_reply(request_id: int, ok: bool, value: Any) -> bytes:
    return _pack([request_id, ok, value])


def decode_reply(frame: bytes) -> Reply:
    msg = _unpack(frame)
    if not isinstance(msg, list) or len(msg) != 3:
        raise DecodeError("a reply must be a 3-item array [request_id, ok, value]")
    request_id, ok, value = msg
    if not isinstance(request_id, int) or not isinstance(ok, bool):
        raise DecodeError("a reply's request_id must be an int and ok a bool")
    return Reply(request_id, ok, value)
