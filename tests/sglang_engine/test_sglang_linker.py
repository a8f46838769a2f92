"""kvstrata's linker inside a real SGLang 0.5.23 engine on CPU, against a real ``kvstrata serve``.

Skipped where SGLang is not installed; ``tox -e sglang`` installs it and runs these. Each engine is a fresh
subprocess (sglang_runner.py) that goes through a list of steps, so one engine start serves several
checks: a CPU engine takes some 20 s to start. ``flush_cache`` between steps drops SGLang's own device
prefix cache, so a prompt seen before can only come back from kvstrata.

The engines: a baseline without kvstrata (conftest.py, shared with the HiCache tests); a first linker
engine that computes and offloads prompts, then loads them (alone, two in one batch, a prompt extending a
cached one) and has one load fail part way; a fresh linker engine that reads what the first stored, with
a control that alters one stored layer, and that goes on serving after the server is killed.

No engine leaves a kvstrata shared-memory segment behind (engine.py's ``run_sglang`` checks each): the first
engine stops as SGLang's HTTP server stops it (a ``ShutdownReq``: SGLang closes the linker, which unregisters
and removes its segments), the fresh one with the offline ``Engine.shutdown`` alone (SIGKILL: the adapter's
watcher removes what the killed scheduler created).
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (tox -e sglang installs sglang 0.5.23)")

from engine import (  # noqa: E402  (beside this file)
    HEAD_SIZE,
    KV_HEADS,
    LAYERS,
    P1,
    P2,
    P3,
    PAGE,
    assert_same,
    linker_engine,
    read_record,
    run_sglang,
)
from kvstrata.conformance_tests.slice_hold import HeldServerProcess as ServerProcess  # noqa: E402
from kvstrata.conformance_tests.slice_hold import UNTIL_ENGINE_WAITED, SliceHold  # noqa: E402

FLUSH = {"flush": True}


@pytest.fixture(scope="module")
def server():
    # one page per chunk: SGLang keys the tail past its own device hit, which may start at any page
    with ServerProcess(chunk_size=PAGE, l1_bytes=128 << 20) as srv:
        yield srv


@pytest.fixture(scope="module")
def first_engine(work, server):
    """Computes and offloads P1 and P2, then loads them back; one load is held past the layer-wait bound."""
    tmp, _ = work
    record = tmp / "first.jsonl"
    hold = SliceHold(tmp / "hold-first")
    # each hit is held after its first slice until the record shows a layer wait made while it was in flight
    hold.hold("hit-", after_slices=1, until=UNTIL_ENGINE_WAITED, record_path=str(record))
    # this one is held after its first layer until opened: layer 1's wait (bound 3 s) fails the load part way
    hold.hold("fail-", after_slices=1, timeout=120.0)
    steps = [
        {"generate": [P1]}, {"generate": [P2]}, FLUSH,                   # 0, 1: computed and offloaded
        {"generate": [P1], "rids": ["hit-p1"]}, FLUSH,                  # 3: loaded
        {"generate": [P1, P2], "rids": ["hit-b1", "hit-b2"]}, FLUSH,    # 5: two loads in one batch
        {"generate": [P3], "rids": ["hit-p3"]}, FLUSH,                  # 7: P1's pages loaded, the rest computed
        {"generate": [P2], "rids": ["fail-p2"]},                        # 9: fails after one layer
        {"open_hold": "fail-"}, FLUSH,
        {"generate": [P1], "rids": ["hit-after-failure"]},              # 12: the engine serves the next one
    ]
    out = run_sglang(tmp, "first", steps, linker_engine(server.address, record, layer_wait_timeout=3.0),
                     slice_hold=hold)
    return out, read_record(record)


def test_loaded_prompts_equal_a_run_without_kvstrata_alone_batched_and_extended(work, first_engine):
    _, base = work
    out, record = first_engine
    steps = out["steps"]
    assert_same(steps[0][0], base["P1"], "P1, computed and offloaded")
    assert_same(steps[1][0], base["P2"], "P2, computed and offloaded")
    assert_same(steps[3][0], base["P1"], "P1 after flush_cache, loaded from kvstrata")
    assert_same(steps[5][0], base["P1"], "P1, loaded in one batch with P2")
    assert_same(steps[5][1], base["P2"], "P2, loaded in one batch with P1")
    assert_same(steps[7][0], base["P3"], "P3, extending the cached P1")
    loads = {e["request_id"]: e["tokens"] for e in record if e["event"] == "load_started"}
    assert loads["hit-p1"] == 192 and loads["hit-p3"] == 192, loads  # P1's 12 whole pages, in both
    located = {e["request_id"]: e["located_by"] for e in record if e["event"] == "load_started"}
    assert set(located.values()) == {"lookup"}, f"a load asked RETRIEVE where its LOOKUP had located it: {located}"
    assert loads["hit-b1"] == 192 and loads["hit-b2"] == 144, loads
    batch = [e for e in record if e["event"] == "load_started" and e["request_id"] in ("hit-b1", "hit-b2")]
    # one start_layer_wise_loading for both: their loads went out together, before either settled
    settled_b = [i for i, e in enumerate(record) if e["event"] == "settled" and e["request_id"] in ("hit-b1", "hit-b2")]
    started_b = [i for i, e in enumerate(record) if e in batch]
    assert len(started_b) == 2 and max(started_b) < min(settled_b), "the two loads did not run in one batch"
    # SGLang offloads every whole page it computed KV for: a prompt and its outputs but the last one. Each
    # distinct page is stored once however often the prompt comes back: P1 (12 pages), P2 (9), and the 5
    # pages of P3 past P1's 12
    pages = sum((len(p) + 8 - 1) // PAGE for p in (P1, P2)) + (len(P3) + 8 - 1) // PAGE - len(P1) // PAGE
    stored = sum(e["stored_tokens"] for e in record if e["event"] == "stored")
    assert stored == pages * PAGE, (stored, pages)


def test_the_record_shows_per_layer_waits_while_each_load_was_in_flight(first_engine):
    _, record = first_engine
    hits = ["hit-p1", "hit-b1", "hit-b2", "hit-p3", "hit-after-failure"]
    for rid in hits:
        released = [e for e in record if e["event"] == "released" and e["request_id"] == rid]
        assert released and released[0]["released_before_complete"] is True, (rid, released)
        waited = {e["layer"] for e in record if e["event"] == "wait_for_layer_load" and rid in e["in_flight"]}
        assert 0 in waited, f"{rid}: no layer wait happened while its load was in flight"
        settled = [e for e in record if e["event"] == "settled" and e["request_id"] == rid]
        assert settled and settled[0]["failure"] is None, (rid, settled)
    # every layer of every successful batch was waited on: the loader completes SGLang's counter layer by
    # layer, each only after the runtime's wait for it returned (4 batches: hit-p1, the pair, hit-p3, the last)
    per_layer = [sum(1 for e in record if e["event"] == "wait_for_layer_load" and e["layer"] == layer)
                 for layer in range(LAYERS)]
    assert min(per_layer) >= 4, per_layer


def test_a_load_failing_part_way_fails_that_request_and_the_next_is_served(work, first_engine):
    _, base = work
    out, record = first_engine
    failed = out["steps"][9][0]
    assert "error" in failed, f"the request whose load failed was answered anyway: {failed}"
    assert "External KV cache load failed" in failed["error"], failed
    reasons = [e["reason"] for e in record if e["event"] == "load_failed" and e["request_id"] == "fail-p2"]
    assert reasons and reasons[0].startswith("layer 1:"), reasons  # layer 0 landed, layer 1 did not
    assert_same(out["steps"][12][0], base["P1"], "P1 after the failed load")


def test_a_fresh_engine_reads_what_the_first_stored_and_an_altered_layer_changes_outputs(work, server,
                                                                                       first_engine):
    tmp, base = work
    record = tmp / "fresh.jsonl"
    corrupt = {"server_address": server.address, "model": str(tmp / "model"), "tokens": P2, "page_size": PAGE,
               "layer": 2, "num_layers": LAYERS, "num_heads": KV_HEADS, "head_size": HEAD_SIZE}
    steps = [
        {"generate": [P1], "rids": ["fresh-p1"]}, FLUSH,       # 0: loaded from what the first engine stored
        {"generate": [P3], "rids": ["fresh-p3"]}, FLUSH,       # 2
        {"corrupt": corrupt},                                  # 4: layer 2 of P2's stored pages negated
        {"generate": [P2], "rids": ["fresh-p2-altered"]}, FLUSH,  # 5
        {"kill": server.proc.pid},                             # 7: the server dies
        {"generate": [P1], "rids": ["down-p1"]}, FLUSH,        # 8: computed
        {"generate": [P2], "rids": ["down-p2"]},               # 10: computed
    ]
    out = run_sglang(tmp, "fresh", steps, linker_engine(server.address, record, lookup_timeout=1.0),
                     shutdown="kill")
    s = out["steps"]
    assert_same(s[0][0], base["P1"], "P1 in a fresh engine, loaded from kvstrata")
    assert_same(s[2][0], base["P3"], "P3 in a fresh engine")
    assert s[4]["corrupted"]["tokens"] == 144, s[4]
    altered = s[5][0]
    assert "error" not in altered, altered
    assert altered["tokens"] != base["P2"]["tokens"] or \
        max(abs(x - y) for x, y in zip(altered["logprobs"], base["P2"]["logprobs"], strict=True)) > 1e-2, \
        "altering one stored layer did not change the output: the equality checks could not fail"
    assert_same(s[8][0], base["P1"], "P1 with the server killed")
    assert_same(s[10][0], base["P2"], "P2 with the server killed")
    events = read_record(record)
    loads = {e["request_id"] for e in events if e["event"] == "load_started"}
    assert {"fresh-p1", "fresh-p3", "fresh-p2-altered"} <= loads, loads
    assert not loads & {"down-p1", "down-p2"}, loads
    assert not [e for e in events if e["event"] == "load_failed"], events
    # the dead server's LOOKUPs time out (or fail, if the transport notices first): said in the log either way
    assert "did not answer LOOKUP" in out["log"] or "computes the prompt instead" in out["log"]
