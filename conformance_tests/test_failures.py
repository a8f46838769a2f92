"""Rule "failure-reported": a dead or stalled server never hangs the engine, and the failure is reported.

Every case ends the same way a deployment needs it to: the engine's per-layer
wait returns within its bound, the request comes back to the engine, its
blocks are reported to it through the adapter (so the engine recomputes
them instead of reading KV that never arrived), a log line names the request,
and the next retrieve works.
"""

from __future__ import annotations

import time
from typing import Callable

from kvstrata.core.transfer.layouts import PLACEMENT_SERVER

from .checks import catch_in_flight, check_wire_retrieve, read_every_layer
from .rig import Retrieval, Rig
from .rules import broken, require

LAYER_WAIT = 1.0
RETRIEVE_TIMEOUT = 4.0
SLACK = 6.0


def fast_failing(make_rig: Callable[..., Rig], retrieve_timeout: float = RETRIEVE_TIMEOUT, *,
                 own_server: bool = True) -> Rig:
    """A rig whose waits time out soon; with its own server, which the test may kill."""
    return make_rig(layer_wait_timeout=LAYER_WAIT, retrieve_timeout=retrieve_timeout, own_server=own_server)


def wait_reported(rig: Rig, r: Retrieval, within: float, what: str) -> None:
    """The engine was told to recompute every block of ``r`` (through the adapter), and the runtime says why."""
    want = {b for g in r.blocks for b in g}
    deadline = time.monotonic() + within
    while not want <= rig.failed_blocks and time.monotonic() < deadline:
        rig.poll()
        time.sleep(0.01)
    missing = sorted(want - rig.failed_blocks)
    require(not missing, "failure-reported",
            f"{what}, and the engine side never reported blocks {missing[:8]}{'...' if len(missing) > 8 else ''} "
            f"of request {r.request_id} for recompute within {within:.0f}s: the engine would go on to read KV that "
            "never arrived")
    reason = rig.failures().get(r.request_id)
    require(isinstance(reason, str) and reason, "failure-reported",
            f"{what}, and the runtime's record gives no reason for the failure of {r.request_id}")


def require_logged(warning_log: list[str], since: int, r: Retrieval, what: str) -> None:
    require(any(r.request_id in line for line in warning_log[since:]), "failure-reported",
            f"{what}, and no WARNING or ERROR log line names request {r.request_id}")


def wait_bounded(rig: Rig, layer: int, what: str) -> None:
    bound = LAYER_WAIT + SLACK
    raised = None
    try:
        returned, took = rig.wait_for_layer(layer, bound)
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"
    if raised is not None:
        broken("failure-reported", f"{what}, and the engine side's wait for layer {layer} raised {raised} into the "
                                   "engine's thread instead of reporting the failure")
    require(returned, "failure-reported",
            f"{what}, and the engine side's wait for layer {layer} was still blocked after {bound:.0f}s "
            f"(the worker's wait timeout is {LAYER_WAIT}s): the model runner would hang")


def next_retrieve_works(rig: Rig, prompt: list[int], context: str) -> None:
    r = rig.submit(prompt)
    require(rig.wait_released(r, 20), "failure-reported", f"{context}, the next retrieve was never released")
    read_every_layer(rig, r, f"({context}, the next retrieve)")
    rig.settle()
    check_wire_retrieve(rig, r, expect_width=1)
    require(r.request_id not in rig.failures(), "failure-reported",
            f"{context}, the next retrieve failed too: {rig.failures().get(r.request_id)}")


def test_server_killed_mid_transfer(make_rig: Callable[..., Rig], warning_log: list[str]) -> None:
    rig = fast_failing(make_rig)
    prompt = rig.prompt()
    r, landed = catch_in_flight(rig, prompt)
    mark = len(warning_log)
    rig.kill_server()
    what = f"the server was killed with {landed} of {rig.layout.num_layers} layers landed"
    for layer in range(landed):
        rig.check_layer(r, layer, "(landed before the server died)")
    wait_bounded(rig, landed, what)  # fails the load
    # engine placement: the engine side's own copy was held (the dead server's chunks stay mapped); it stops
    # before its next slice, and only then is the engine told to recompute
    rig.resume(r)
    wait_reported(rig, r, SLACK, what)
    require(r.request_id in rig.released, "failure-reported", f"{what}, and the request never came back")
    require_logged(warning_log, mark, r, what)
    rig.settle(RETRIEVE_TIMEOUT + SLACK)
    rig.free(r)
    rig.restart_server()
    next_retrieve_works(rig, prompt, "after the server was killed mid-transfer and restarted")


def test_server_dies_before_the_first_slice(make_rig: Callable[..., Rig], warning_log: list[str]) -> None:
    rig = fast_failing(make_rig)
    prompt = rig.prompt()
    rig.store(prompt)
    mark = len(warning_log)
    # engine placement: the engine side's own copy is held before its first slice, wherever it learnt where
    # the chunks are (its LOOKUP, or a RETRIEVE)
    r = rig.submit(prompt, hold_after_slices=0)
    require(rig.wait_held(r), "retrieve-payload",
            f"the transfer of {r.request_id} never started: the server did not accept the adapter's RETRIEVE, or "
            "the engine side never began its copy")
    rig.kill_server()
    what = "the server died before the first slice landed"
    if rig.placement != PLACEMENT_SERVER:
        worker_copy_outlives_the_server(rig, r, prompt, what, warning_log, mark)
        return
    deadline = time.monotonic() + RETRIEVE_TIMEOUT + SLACK
    while r.request_id not in rig.released and time.monotonic() < deadline:
        rig.poll()
        time.sleep(0.01)
    require(r.request_id in rig.released, "failure-reported",
            f"{what}, and the request was not given back to the engine within "
            f"{RETRIEVE_TIMEOUT + SLACK:.0f}s (retrieve timeout {RETRIEVE_TIMEOUT}s): it would wait forever")
    wait_reported(rig, r, SLACK, what)
    require_logged(warning_log, mark, r, what)
    wait_bounded(rig, 0, what)
    rig.resume(r)
    rig.settle(SLACK)
    rig.free(r)
    rig.restart_server()
    next_retrieve_works(rig, prompt, "after the server died and was restarted")


def worker_copy_outlives_the_server(rig: Rig, r: Retrieval, prompt: list[int], what: str,
                                    warning_log: list[str], mark: int) -> None:
    """Engine placement: the engine side copies from its own mapping of the pool, which the server's death
    does not take away. Once its held copy goes on, the load either lands byte-exact or (its retrieve timeout
    passed while it was held) is reported for recompute; it never hangs."""
    rig.resume(r)
    rig.settle(RETRIEVE_TIMEOUT + SLACK)  # the outcome is known once the load settled, whichever it is
    if r.request_id in rig.failures():
        wait_reported(rig, r, SLACK, what)
        require_logged(warning_log, mark, r, what)
    else:
        require(r.request_id in rig.released, "failure-reported",
                f"{what} while the engine side's copy was held; once it went on, the load settled without "
                "failing and the request never came back")
        read_every_layer(rig, r, f"({what}; the engine side copied from its own mapping of the pool)")
    rig.free(r)
    rig.restart_server()
    next_retrieve_works(rig, prompt, "after the server died and was restarted")


def test_slot_that_never_advances(make_rig: Callable[..., Rig], warning_log: list[str]) -> None:
    rig = fast_failing(make_rig, retrieve_timeout=60.0, own_server=False)  # it stalls the transfer, kills nothing
    prompt = rig.prompt()
    r, landed = catch_in_flight(rig, prompt)
    mark = len(warning_log)
    what = f"the transfer stopped advancing at {landed} of {rig.layout.num_layers} layers"
    wait_bounded(rig, landed, what)
    if rig.placement != PLACEMENT_SERVER:
        # the engine side's own copy stalled: it stops before its next slice, then the engine is told
        rig.resume(r)
    wait_reported(rig, r, SLACK, what)
    require_logged(warning_log, mark, r, what)
    # The stalled transfer goes on late: it settles, the slot returns, nothing hangs.
    rig.resume(r)
    rig.proxy.release_replies(r.request_id)
    rig.settle()
    rig.free(r)
    next_retrieve_works(rig, prompt, "after a stalled retrieve")
