"""Rule "retrieve-payload": what the adapter actually sends, caught on the wire by the recording proxy."""

from __future__ import annotations

from typing import Callable

import pytest

from kvstrata.core.wire.protocol import ProtocolError

from .checks import check_wire_retrieve, read_every_layer
from .rig import Rig
from .rules import broken, require

WIDTHS = [0, 1, 3]
"""Chunk-major, one layer per slice, and a width that does not divide the layer count."""


@pytest.mark.parametrize("width", WIDTHS, ids=lambda w: "chunk-major" if w == 0 else f"layer-major-{w}")
def test_retrieve_on_the_wire_has_the_declared_items(make_rig: Callable[..., Rig], width: int) -> None:
    rig = make_rig(width=width)
    prompt = rig.prompt()
    problem = None
    try:
        r = rig.submit(prompt)
    except ProtocolError as exc:
        problem = str(exc)
    if problem is not None:
        broken("retrieve-payload", f"the adapter could not send a {width=} retrieve: {problem}")
    require(rig.wait_released(r, 20), "early-release",
            f"request {r.request_id} ({width=}) was never released to the engine within 20s")
    check_wire_retrieve(rig, r, expect_width=width, replied=False)
    read_every_layer(rig, r, f"(width {width})")
    rig.settle()
    check_wire_retrieve(rig, r, expect_width=width)
    require(not rig.failed_blocks and not rig.failures(), "failure-reported",
            f"a healthy load was reported failed: {rig.failures()}")
