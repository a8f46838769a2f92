"""Checks shared by the conformance tests: a load's RETRIEVE on the wire, and every layer read back."""

from __future__ import annotations

from kvstrata.core.engine.requests import request_of_lock_owner
from kvstrata.core.transfer.layouts import PLACEMENT_SERVER
from kvstrata.core.wire.protocol import ProtocolError, RequestType, declaration

from .rig import Retrieval, Rig
from .rules import broken, require

RELEASE_TIMEOUT = 5.0
"""For a release that comes after the first slice (milliseconds): the transfer is held after it, so a release
that has not come by then comes only once the suite lets the transfer go on."""
REPLY_TIMEOUT = 20.0
BLOCKED_FOR = 0.4
"""How long a wait for a layer that has not landed must stay blocked to count as waiting."""


def check_wire_retrieve(rig: Rig, r: Retrieval, *, expect_width: int | None, replied: bool = True) -> list:
    """The one RETRIEVE ``r`` put on the wire, checked item by item; returns its payload (``None`` for a
    engine-placement load that its LOOKUP located, which sends none).

    ``expect_width`` is the width the load must run at (0: chunk-major); ``None`` skips the mode check. In
    server placement the width travels in the RETRIEVE (with the arrival board); in engine placement the
    engine side copies itself: it starts from where the LOOKUP found the chunks, or sends a RETRIEVE that
    only locates them (tail ``None, None, 0``), and the width is the one the runtime recorded for the load.
    ``replied`` also requires that the server accepted the RETRIEVE.
    """
    sent = rig.retrieves_on_wire(r)
    bad_frames = rig.proxy.undecodable()
    require(not bad_frames, "retrieve-payload",
            f"the adapter sent frames the protocol cannot decode: {[f.decode_error for f in bad_frames]}")
    if rig.placement != PLACEMENT_SERVER:
        started = rig.loads_started(r)
        by_lookup = bool(started) and started[0].get("located_by") == "lookup"
        how = "its LOOKUP" if by_lookup else "RETRIEVE"
        require(len(sent) == (0 if by_lookup else 1), "retrieve-payload",
                f"the engine-placement load of {r.request_id} was located by {how} and put {len(sent)} RETRIEVE "
                f"requests on the wire (expected {0 if by_lookup else 1})")
        if by_lookup:
            check_recorded_width(rig, r, expect_width)
            return None
    require(len(sent) == 1, "retrieve-payload",
            f"one load of request {r.request_id} put {len(sent)} RETRIEVE requests on the wire")
    req = sent[0]
    problem = None
    try:
        declaration(RequestType.RETRIEVE).validate(req.payload)
    except ProtocolError as exc:
        problem = str(exc)
    if problem is not None:
        broken("retrieve-payload", f"the RETRIEVE that arrived at the server: {problem}")
    payload = req.payload
    tail = payload[5:]
    if rig.placement != PLACEMENT_SERVER:
        require(tail == [None, None, 0], "retrieve-payload",
                f"a engine-placement RETRIEVE only locates the chunks and must end with (None, None, 0); it "
                f"ended with {tail!r}")
        check_recorded_width(rig, r, expect_width)
    elif expect_width == 0:
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
    require(request_of_lock_owner(payload[0]["request_id"]) == r.request_id, "retrieve-payload",
            f"the RETRIEVE's key names request {payload[0]['request_id']!r} (a lock owner: the request id, then "
            f"'@i' and the instance), the load was {r.request_id!r}")
    require(payload[2] == r.blocks, "retrieve-payload",
            f"the RETRIEVE's block_ids {payload[2]!r} are not the blocks the engine allocated {r.blocks!r}")
    if req.reply is None and not replied:
        return payload
    if req.reply is None:
        # the engine side may settle on the board's "complete" word before the reply reaches the proxy
        rig.proxy.wait_for(lambda: req.reply is not None, REPLY_TIMEOUT)
    require(req.reply is not None and req.reply.ok, "retrieve-payload",
            f"the server rejected the adapter's RETRIEVE: {req.reply.value if req.reply else 'no reply'}")
    return payload


def check_recorded_width(rig: Rig, r: Retrieval, expect_width: int | None) -> None:
    """Engine placement: the width the engine side's record shows the load ran at is ``expect_width``."""
    if expect_width is None:
        return
    asked = [e["layers_per_slice"] for e in rig.loads_started(r)]
    ran = 0 if rig.fallbacks(r) else (asked[0] if asked else None)
    require(ran == expect_width, "retrieve-payload",
            f"the load of {r.request_id} was to run at width {expect_width}; the engine side's record "
            f"shows width {asked} asked{' and a fallback' if rig.fallbacks(r) else ''}")


def read_every_layer(rig: Rig, r: Retrieval, context: str) -> None:
    for layer in range(rig.layout.num_layers):
        returned, took = rig.wait_for_layer(layer, rig.layer_wait_timeout + 10)
        require(returned, "layer-wait", f"the engine side's wait for layer {layer} did not return within "
                                        f"{rig.layer_wait_timeout + 10:.0f}s {context}")
        rig.check_layer(r, layer, context)


def catch_in_flight(rig: Rig, prompt: list[int]) -> tuple[Retrieval, int]:
    """Submit with the transfer held after its first slice (and, in server placement, its reply held); wait
    for the release: (retrieval, layers landed). The transfer goes on only at ``rig.resume(r)``, so it is in
    flight for as long as the test needs, whatever the machine's speed."""
    n = rig.layout.num_layers
    # server placement: with the reply held, only the arrival board can tell the engine side anything
    r = rig.submit(prompt, hold_reply=rig.placement == PLACEMENT_SERVER, hold_after_slices=1)
    require(rig.wait_held(r), "retrieve-payload",
            f"the transfer of {r.request_id} never started: the server did not accept the adapter's RETRIEVE, or "
            "the engine side never asked for it")
    released = rig.wait_released(r, RELEASE_TIMEOUT)
    landed = n
    if rig.placement == PLACEMENT_SERVER:
        progress = rig.board_progress(r)
        require(progress is not None, "retrieve-payload",
                f"the layer-major RETRIEVE of {r.request_id} named no readable arrival board")
        landed = progress.layers
    else:
        started = rig.loads_started(r)
        if started and started[0]["layers_per_slice"] > 0:
            landed = min(started[0]["layers_per_slice"], n)
    if not released:
        broken("early-release",
               f"request {r.request_id} was not released within {RELEASE_TIMEOUT:.0f}s while its transfer was "
               f"held with {landed} of {n} layers landed: the engine side waits for the whole transfer instead of "
               "releasing on the first slice")
    if landed >= n:
        broken("early-release",
               f"the load of {r.request_id} moved all {n} layers in its first slice: the engine side did not ask "
               f"for width {rig.width}, so nothing could be released before the transfer ended")
    return r, landed
