"""Rules "early-release" and "layer-wait": released on the first slice, and the per-layer wait is honoured.

The server is a real process; the suite catches the transfer in flight by
holding the transfer after its first slice (the test-only slice hold, in the
server or, for engine placement, in the engine side's process) and, in server
placement, the RETRIEVE reply at the proxy (so only the arrival board can tell
the engine side anything). Then the landed layers must read correctly at
once, the next layer's wait must block for as long as the server holds, and once
it goes on every remaining layer must read correctly after its wait.
"""

from __future__ import annotations

from .checks import BLOCKED_FOR, catch_in_flight, check_wire_retrieve
from .rig import Rig
from .rules import broken, require

def test_released_on_first_slice_and_every_layer_read_after_its_wait(rig: Rig) -> None:
    n = rig.layout.num_layers
    prompt = rig.prompt()
    r, landed = catch_in_flight(rig, prompt)
    check_wire_retrieve(rig, r, expect_width=1, replied=False)
    if rig.placement == "server":
        require(rig.proxy.reply_held(r.request_id) or not rig.retrieves_on_wire(r)[-1].reply, "early-release",
                "the request was released, but the suite did not actually hold back its RETRIEVE reply")
    # Layers that landed before the pause: their waits return, their bytes are right.
    for layer in range(landed):
        returned, took = rig.wait_for_layer(layer, 5.0)
        require(returned, "layer-wait",
                f"the engine side's layer wait({layer}) blocked although layer {layer} had landed ({landed} of {n})")
        rig.check_layer(r, layer, f"(landed before the server held the transfer at {landed} of {n} layers)")
    # The first layer that has not landed: the wait must block while the server holds the transfer.
    done, error = rig.start_wait(landed)
    if done.wait(BLOCKED_FOR):
        what = f"raised {type(error[0]).__name__}: {error[0]}" if error else "returned"
        broken("layer-wait",
               f"the engine side's layer wait({landed}) {what} within {BLOCKED_FOR}s while the server held the transfer with "
               f"only {landed} of {n} layers landed: the engine would read layer {landed} before its KV arrived")
    rig.resume(r)
    require(done.wait(rig.layer_wait_timeout + 10), "layer-wait",
            f"the engine side's layer wait({landed}) did not return after the server went on")
    require(not error, "layer-wait", f"the engine side's layer wait({landed}) raised {error[0]!r}" if error else "")
    rig.check_layer(r, landed, "(the layer the wait blocked on)")
    for layer in range(landed + 1, n):
        returned, took = rig.wait_for_layer(layer, rig.layer_wait_timeout + 10)
        require(returned, "layer-wait", f"the engine side's layer wait({layer}) did not return after the server went on")
        rig.check_layer(r, layer, "(after the server went on)")
    rig.proxy.release_replies(r.request_id)
    rig.settle()
    require(not rig.failed_blocks and not rig.failures(), "failure-reported",
            f"a healthy load was reported failed: {rig.failures()}")
    check_wire_retrieve(rig, r, expect_width=1)
