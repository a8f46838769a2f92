"""Rule "fallback": a retrieve layer-major staging cannot serve runs chunk-major, and says why once.

Two cases reach every adapter: a hybrid cache (several KV groups; the planner
stages one group only) and an exhausted arrival pool (no slot to publish
progress on). Both must degrade, not fail: the retrieve goes out chunk-major,
every byte arrives, and a WARNING names the reason -- once, not per request.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import pytest

from kvstrata.core.adapter_api.hookspecs import HarnessSpec, NotSupported, WorkerOptions

from .checks import check_wire_retrieve, read_every_layer
from .rig import Rig
from .rules import broken, require

HYBRID_RETRIEVES = 3


def _fallback_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if "chunk-major" in line]


def test_hybrid_cache_degrades_to_chunk_major_and_logs_once(make_rig: Callable[..., Rig], warning_log: list[str],
                                                            session_state: dict[str, Any]) -> None:
    try:
        rig = make_rig(spec=HarnessSpec(kv_groups=2, num_blocks=256))
    except NotSupported as exc:
        pytest.skip(f"the adapter's engine cannot build a hybrid cache: {exc}")
    require(rig.layout.is_hybrid, "kv-layout",
            "the engine was built with 2 KV groups but the layout describes one (layer_groups not set)")
    prompt = rig.prompt()
    rig.store(prompt)
    mark = len(warning_log)
    for i in range(HYBRID_RETRIEVES):
        r = rig.submit(prompt, width=1)
        require(rig.wait_released(r, 20), "fallback",
                f"hybrid retrieve {i + 1} asked for layer-major was never released within 20s")
        check_wire_retrieve(rig, r, expect_width=None, replied=False)
        tail = rig.retrieves_on_wire(r)[0].payload[5:]
        require(tail == [None, None, 0], "fallback",
                f"a layer-major retrieve into a hybrid cache must go out chunk-major, (None, None, 0) as the "
                f"RETRIEVE tail; retrieve {i + 1} sent {tail!r}")
        read_every_layer(rig, r, f"(hybrid retrieve {i + 1}, degraded to chunk-major)")
        rig.settle()
        check_wire_retrieve(rig, r, expect_width=0)
        rig.free(r)
    require(not rig.failed, "fallback", f"a degraded retrieve was reported failed: {rig.failed}")
    during = _fallback_lines(warning_log[mark:])
    repeated = {line: n for line, n in Counter(during).items() if n > 1}
    require(not repeated, "fallback",
            f"{HYBRID_RETRIEVES} degraded retrieves logged the same reason more than once: {repeated}")
    require(during or session_state.get("hybrid_fallback_logged"), "fallback",
            f"{HYBRID_RETRIEVES} retrieves degraded to chunk-major and no WARNING said so (expected a line naming "
            "chunk-major and the reason)")
    session_state["hybrid_fallback_logged"] = True


def test_exhausted_arrival_pool_degrades_and_recovers(make_rig: Callable[..., Rig], warning_log: list[str]) -> None:
    rig = make_rig(options=WorkerOptions(pool_slots=1, layer_wait_timeout=5.0, retrieve_timeout=30.0))
    first, second = rig.prompt(), rig.prompt()
    rig.store(first)
    rig.store(second)
    # The only slot stays taken while the first retrieve is held after its first slice, its reply held back.
    a = rig.submit(first, width=1, hold_reply=True, hold_after_slices=1)
    require(rig.wait_released(a, 10), "early-release",
            f"request {a.request_id} was not released on its first slice while its reply was held")
    mark = len(warning_log)
    b = rig.submit(second, width=1)
    require(rig.wait_released(b, 20), "failure-reported",
            "a retrieve submitted while the arrival pool was empty was never released to the engine (20s)")
    check_wire_retrieve(rig, b, expect_width=None, replied=False)
    tail = rig.retrieves_on_wire(b)[0].payload[5:]
    require(tail == [None, None, 0], "fallback",
            f"with WorkerOptions(pool_slots=1) and the slot taken, a layer-major retrieve must go out chunk-major; "
            f"it sent {tail!r} (does kvstrata_create_worker honour WorkerOptions.pool_slots?)")
    require(_fallback_lines(warning_log[mark:]), "fallback",
            "a retrieve degraded because the arrival pool was exhausted and no WARNING said so")
    rig.resume(a)
    rig.proxy.release_replies(a.request_id)
    read_every_layer(rig, b, "(retrieve that found the pool empty)")
    read_every_layer(rig, a, "(retrieve that held the only slot)")
    rig.settle()
    require(not rig.failed, "failure-reported", f"retrieves were reported failed: {rig.failed}")
    rig.free(a)
    rig.free(b)
    # The slot came back: the next layer-major retrieve gets it.
    c = rig.submit(first, width=1)
    require(rig.wait_released(c, 20), "early-release", "the retrieve after the pool drained was never released")
    read_every_layer(rig, c, "(retrieve after the pool drained)")
    rig.settle()
    check_wire_retrieve(rig, c, expect_width=1)
    if not rig.retrieves_on_wire(c)[0].payload[5]:
        broken("fallback", "after the pool drained, the next layer-major retrieve still went out without a slot")
