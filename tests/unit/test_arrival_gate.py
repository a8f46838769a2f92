"""LayerArrivalGate with no server and no GPU: release policy, per-slice waits, failure, bounded waits."""

import threading
import time

import pytest

from kvstrata.core.arrival.gate import LayerArrivalGate, LayerWaitTimeout, TransferFailed


def test_releases_after_the_first_layer_by_default():
    g = LayerArrivalGate(32)
    assert not g.release_ready()
    g.record_slice(0, 1)
    assert g.release_ready()


def test_release_policy_counts_contiguous_layers_from_zero():
    g = LayerArrivalGate(8, release_after_layers=2)
    g.record_slice(1, 1)  # a later layer first does not count
    assert not g.release_ready() and g.arrived_layers == 0
    g.record_slice(0, 1)
    assert g.release_ready() and g.arrived_layers == 2


def test_release_after_more_layers_than_exist_means_all_layers():
    g = LayerArrivalGate(2, release_after_layers=5)
    g.record_slice(0, 1)
    assert not g.release_ready()
    g.record_slice(1, 1)
    assert g.release_ready() and g.complete


def test_a_slice_of_n_layers_costs_one_wait():
    g = LayerArrivalGate(32)
    handed = []
    for start in range(0, 32, 8):
        g.record_slice(start, 8, completion=f"event@{start}")
    for layer in range(32):
        g.wait_for_layer(layer, timeout=1.0, on_completion=handed.append)
    assert handed == ["event@0", "event@8", "event@16", "event@24"]


def test_wait_returns_only_once_another_thread_recorded_the_slice():
    """The recorder records layer L only after the engine thread has started waiting for it, and marks it
    just before recording: a wait that returned on an unrecorded layer would see the mark missing."""
    g = LayerArrivalGate(4)
    got = []
    waiting = [threading.Event() for _ in range(4)]
    recording: list[int] = []

    def transfer():
        for layer in range(4):
            assert waiting[layer].wait(60), "the engine thread never waited"
            recording.append(layer)
            g.record_slice(layer, 1, completion=layer)

    t = threading.Thread(target=transfer)
    t.start()
    for layer in range(4):
        waiting[layer].set()
        g.wait_for_layer(layer, timeout=60.0, on_completion=got.append)
        assert layer in recording, f"wait_for_layer({layer}) returned before the layer was recorded"
    t.join(60)
    assert got == [0, 1, 2, 3]


def test_wait_is_bounded_and_failure_is_raised():
    g = LayerArrivalGate(4)
    g.record_slice(0, 1)
    start = time.monotonic()
    with pytest.raises(LayerWaitTimeout, match="layer 1 did not arrive within 0.100s .1 of 4 layers landed"):
        g.wait_for_layer(1, timeout=0.1)
    assert time.monotonic() - start >= 0.1  # it waited out its timeout (a lower bound: no machine is too slow)
    g.fail("server died")
    with pytest.raises(TransferFailed, match="server died"):
        g.wait_for_layer(2, timeout=60.0)
    # what did land is still usable
    assert g.wait_for_layer(0, timeout=0.1) is True


def test_refresh_is_polled_while_waiting():
    g = LayerArrivalGate(2)
    calls = []

    def refresh():
        calls.append(1)
        if len(calls) == 3:
            g.record_slice(0, 2)

    assert g.wait_for_layer(1, timeout=2.0, refresh=refresh) is True
    assert len(calls) == 3


def test_rejects_slices_outside_the_layer_range():
    g = LayerArrivalGate(4)
    with pytest.raises(ValueError, match="outside 4 layers"):
        g.record_slice(3, 2)
    with pytest.raises(ValueError):
        LayerArrivalGate(4, release_after_layers=0)


def test_a_slice_covering_several_layers_hands_its_completion_over_once():
    g = LayerArrivalGate(4)
    g.record_slice(0, 2, "e0")
    g.record_slice(2, 1, "e2")
    handed = []
    assert g.wait_for_layer(0, 60, on_completion=handed.append)
    assert not g.wait_for_layer(1, 60, on_completion=handed.append) and handed == ["e0"]
    assert g.wait_for_layer(2, 60, on_completion=handed.append)
    assert handed == ["e0", "e2"]


def test_release_waits_until_the_first_slices_bytes_have_landed():
    """On a GPU a slice is recorded when its copy is enqueued; the request goes back only once it ran."""
    landed = {"s0": False, "s1": False}
    g = LayerArrivalGate(4, release_after_layers=2)
    g.record_slice(0, 1, "s0")
    g.record_slice(1, 3, "s1")
    assert g.release_ready() and not g.release_ready(landed.get)
    landed["s0"] = True
    assert not g.release_ready(landed.get), "layer 1's slice has not landed yet"
    landed["s1"] = True
    assert g.release_ready(landed.get)


def test_slices_recorded_together_count_as_recorded_one_by_one_and_a_bad_one_records_none():
    g = LayerArrivalGate(8)
    g.record_slice(0, 1, "e0")
    with pytest.raises(ValueError, match=r"slice \[7, 9\) is outside 8 layers"):
        g.record_slices([(1, 3), (7, 2)], ["e1", "e7"])
    with pytest.raises(ValueError, match="2 slices with 1 completions"):
        g.record_slices([(1, 3), (4, 4)], ["e1"])
    assert g.arrived_layers == 1, "nothing of a refused batch is recorded"
    g.record_slices([(4, 4), (1, 3)], ["e4", "e1"])  # out of order, as a shared-tier fill may land them
    assert g.arrived_layers == 8 and g.complete
    handed = []
    for layer in range(8):
        g.wait_for_layer(layer, 60, on_completion=handed.append)
    assert handed == ["e0", "e1", "e4"]
