"""Checks shared by the conformance tests: a retrieve's RETRIEVE on the wire, and every layer read back."""

from __future__ import annotations

from kvstrata.core.wire.protocol import ProtocolError, RequestType, declaration

from .rig import Retrieval, Rig
from .rules import broken, require


def check_wire_retrieve(rig: Rig, r: Retrieval, *, expect_width: int | None, replied: bool = True) -> list:
    """The one RETRIEVE ``r`` put on the wire, checked item by item; returns its payload.

    ``expect_width`` 0 means the retrieve must be chunk-major on the wire;
    ``None`` skips the mode check (the caller checks it). ``replied`` also
    requires that the server accepted it (its reply has arrived and is not an
    error); without it, only a reply that did arrive is checked.
    """
    sent = rig.retrieves_on_wire(r)
    bad_frames = rig.proxy.undecodable()
    require(not bad_frames, "retrieve-payload",
            f"the adapter sent frames the protocol cannot decode: {[f.decode_error for f in bad_frames]}")
    require(len(sent) == 1, "retrieve-payload",
            f"one retrieve of request {r.request_id} put {len(sent)} RETRIEVE requests on the wire")
    req = sent[0]
    problem = None
    try:
        declaration(RequestType.RETRIEVE).validate(req.payload)
    except ProtocolError as exc:
        problem = str(exc)
    if problem is not None:
        mode = "chunk-major" if r.width == 0 else f"width-{r.width} layer-major"
        broken("retrieve-payload", f"the RETRIEVE that arrived at the server for a {mode} retrieve: {problem}")
    payload = req.payload
    tail = payload[5:]
    if expect_width == 0:
        require(tail == [None, None, 0], "retrieve-payload",
                f"a chunk-major RETRIEVE must end with (None, None, 0); it ended with {tail!r}")
    elif expect_width is not None:
        require(isinstance(tail[0], dict), "retrieve-payload",
                f"a layer-major RETRIEVE (width {expect_width}) must name an arrival board; it sent {tail[0]!r}")
        require(tail[2] == expect_width, "retrieve-payload",
                f"a layer-major RETRIEVE must carry the width it was asked for ({expect_width}); it sent {tail[2]!r}")
        if tail[1] is not None and len(tail[1]) != rig.layout.num_layers:
            broken("retrieve-payload", f"layer_event_handles must be None (host events) or one handle per layer "
                                       f"({rig.layout.num_layers}); it sent {len(tail[1])}")
    require(payload[0]["request_id"] == r.request_id, "retrieve-payload",
            f"the RETRIEVE's key names request {payload[0]['request_id']!r}, the retrieve was {r.request_id!r}")
    require(payload[2] == r.blocks, "retrieve-payload",
            f"the RETRIEVE's block_ids {payload[2]!r} are not the blocks the engine allocated {r.blocks!r}")
    if req.reply is None and not replied:
        return payload
    if req.reply is None:
        # a worker may settle on the board's "complete" word before the reply reaches the proxy: wait for it
        rig.proxy.wait_for(lambda: req.reply is not None, REPLY_TIMEOUT)
    require(req.reply is not None and req.reply.ok, "retrieve-payload",
            f"the server rejected the adapter's RETRIEVE: {req.reply.value if req.reply else 'no reply'}")
    return payload


def read_every_layer(rig: Rig, r: Retrieval, context: str) -> None:
    for layer in range(rig.layout.num_layers):
        returned, took = rig.wait_for_layer(layer, rig.options.layer_wait_timeout + 10)
        require(returned, "layer-wait", f"kvstrata_wait_for_layer({layer}) did not return within "
                                        f"{rig.options.layer_wait_timeout + 10:.0f}s {context}")
        rig.check_layer(r, layer, context)


RELEASE_TIMEOUT = 5.0
"""For a release that comes after the first slice (milliseconds): the transfer is held after it, so a release
that has not come by then comes only once the suite lets the transfer go on."""
REPLY_TIMEOUT = 20.0
BLOCKED_FOR = 0.4
"""How long a wait for a layer that has not landed must stay blocked to count as waiting."""


def catch_in_flight(rig: Rig, prompt: list[int], width: int = 1):
    """Submit with the reply held and the transfer held after its first slice; wait for the release:
    (retrieval, layers landed). The server goes on only at ``rig.resume(r)``, so the transfer is in flight
    for as long as the test needs, whatever the machine's speed."""
    n = rig.layout.num_layers
    r = rig.submit(prompt, width, hold_reply=True, hold_after_slices=1)
    released = rig.wait_released(r, RELEASE_TIMEOUT)
    progress = rig.board_progress(r)
    require(progress is not None, "retrieve-payload",
            f"the layer-major RETRIEVE of {r.request_id} named no readable arrival board")
    if not released:
        broken("early-release",
               f"request {r.request_id} was not released within {RELEASE_TIMEOUT:.0f}s while the suite held "
               f"back its RETRIEVE reply, although {progress.layers} of {n} layers had landed: the adapter waits "
               "for the whole transfer instead of releasing on the first slice")
    if progress.layers >= n or progress.complete:
        broken("early-release",
               f"the RETRIEVE of {r.request_id} moved all {n} layers in its first slice: the adapter did not ask "
               f"for width {width}, so nothing could be released before the transfer ended")
    return r, progress.layers
