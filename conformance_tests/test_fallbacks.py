"""Rule "fallback": a retrieve layer-major staging cannot serve runs chunk-major, and says why once.

Two cases reach every adapter: a hybrid cache (several KV groups; the planner
stages one group only) and an exhausted arrival pool (no slot to publish
progress on). Both must degrade, not fail: the retrieve goes out chunk-major,
every byte arrives, and a WARNING names the reason -- once, not per request.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import pytest

from kvstrata.core.adapter_api.types import HarnessSpec, NotSupported
from kvstrata.core.transfer.layouts import PLACEMENT_SERVER

from .checks import check_wire_retrieve, read_every_layer
from .rig import Rig
from .rules import broken, require

HYBRID_RETRIEVES = 3


def require_logged_once(warning_log: list[str], mark: int, reasons: set[str], what: str) -> None:
    """Each fallback reason the runtime recorded for the run under test appears in a WARNING of this process
    (logged once per process: possibly before ``mark``), and no line naming it repeats after ``mark``."""
    require(reasons, "fallback", f"{what} degraded and the runtime recorded no reason")
    for reason in reasons:
        lines = [line for line in warning_log if reason in line]
        require(lines, "fallback", f"{what} degraded because {reason!r} (the runtime's record), and no WARNING "
                                   "of this process names that reason")
        repeated = {line: n for line, n in Counter(line for line in warning_log[mark:] if reason in line).items()
                    if n > 1}
        require(not repeated, "fallback", f"{what} logged the same fallback more than once: {repeated}")


def test_hybrid_cache_degrades_to_chunk_major_and_logs_once(make_rig: Callable[..., Rig],
                                                            warning_log: list[str]) -> None:
    try:
        rig = make_rig(spec=HarnessSpec(kv_groups=2, num_blocks=256))
    except NotSupported as exc:
        pytest.skip(f"the adapter's engine cannot build a hybrid cache: {exc}")
    require(rig.layout.is_hybrid, "kv-layout",
            "the engine was built with 2 KV groups but the layout describes one (layer_groups not set)")
    prompt = rig.prompt()
    rig.store(prompt)
    mark = len(warning_log)
    retrievals = []
    for i in range(HYBRID_RETRIEVES):
        r = rig.submit(prompt)
        retrievals.append(r)
        require(rig.wait_released(r, 20), "fallback",
                f"hybrid retrieve {i + 1} asked for layer-major was never released within 20s")
        payload = check_wire_retrieve(rig, r, expect_width=None, replied=False)
        if payload is not None:  # None: a engine-placement load its LOOKUP located (its record says the width)
            require(payload[5:] == [None, None, 0], "fallback",
                    f"a layer-major retrieve into a hybrid cache must go out chunk-major, (None, None, 0) as the "
                    f"RETRIEVE tail; retrieve {i + 1} sent {payload[5:]!r}")
        rig.settle()
        require(rig.fallbacks(r), "fallback",
                f"hybrid retrieve {i + 1} ran chunk-major, and the runtime's record of {r.request_id} gives no "
                "fallback reason")
        read_every_layer(rig, r, f"(hybrid retrieve {i + 1}, degraded to chunk-major)")
        rig.settle()
        check_wire_retrieve(rig, r, expect_width=0)
        rig.free(r)
    require(not rig.failed_blocks and not rig.failures(), "fallback",
            f"a degraded retrieve was reported failed: {rig.failures()}")
    reasons = {reason for r in retrievals for reason in rig.fallbacks(r)}
    require_logged_once(warning_log, mark, reasons, f"{HYBRID_RETRIEVES} hybrid retrieves")


def test_exhausted_arrival_pool_degrades_and_recovers(make_rig: Callable[..., Rig], warning_log: list[str]) -> None:
    rig = make_rig(pool_slots=1)
    if rig.placement != PLACEMENT_SERVER:
        pytest.skip("engine placement publishes progress in-process: it has no arrival pool to exhaust")
    first, second = rig.prompt(), rig.prompt()
    rig.store(first)
    rig.store(second)
    # The only slot stays taken while the first retrieve is held after its first slice, its reply held back.
    a = rig.submit(first, hold_reply=True, hold_after_slices=1)
    require(rig.wait_released(a, 10), "early-release",
            f"request {a.request_id} was not released on its first slice while its reply was held")
    mark = len(warning_log)
    b = rig.submit(second)
    require(rig.wait_released(b, 20), "failure-reported",
            "a retrieve submitted while the arrival pool was empty was never released to the engine (20s)")
    check_wire_retrieve(rig, b, expect_width=None, replied=False)
    tail = rig.retrieves_on_wire(b)[0].payload[5:]
    require(tail == [None, None, 0], "fallback",
            f"with pool_slots=1 and the slot taken, a layer-major retrieve must go out chunk-major; it sent "
            f"{tail!r} (does the engine side honour the pool_slots setting?)")
    rig.resume(a)
    rig.proxy.release_replies(a.request_id)
    read_every_layer(rig, b, "(retrieve that found the pool empty)")
    read_every_layer(rig, a, "(retrieve that held the only slot)")
    rig.settle()
    require(rig.fallbacks(b), "fallback",
            f"retrieve {b.request_id} ran chunk-major because the pool was exhausted, and the runtime's record gives "
            "no fallback reason")
    require_logged_once(warning_log, mark, set(rig.fallbacks(b)), "a retrieve that found the pool exhausted")
    require(not rig.failed_blocks and not rig.failures(), "failure-reported",
            f"retrieves were reported failed: {rig.failures()}")
    rig.free(a)
    rig.free(b)
    # The slot came back: the next layer-major retrieve gets it.
    c = rig.submit(first)
    require(rig.wait_released(c, 20), "early-release", "the retrieve after the pool drained was never released")
    read_every_layer(rig, c, "(retrieve after the pool drained)")
    rig.settle()
    check_wire_retrieve(rig, c, expect_width=1)
    if not rig.retrieves_on_wire(c)[0].payload[5]:
        broken("fallback", "after the pool drained, the next layer-major retrieve still went out without a slot")
