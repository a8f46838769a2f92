"""kvstrata's HiCache storage backend inside a real SGLang 0.5.23 engine on CPU, against a real server.

HiCache on CPU needs three CUDA-only calls replaced in the engine's processes (hicache_cpu.py says which
and why; nothing of kvstrata's is replaced). Its ``direct`` IO backend runs on CPU with the ``layer_first``
and ``page_first_direct`` host layouts; ``page_first`` needs the ``kernel`` IO backend, whose ops take CUDA
pointer tables, so it does not run here (its layout descriptor is checked in tests/test_sglang_layouts.py).

A writer engine in ``layer_first`` computes prompts and backs them up to kvstrata; after ``flush_cache`` its
hits come from storage. A fresh engine in ``page_first_direct`` reads what the writer stored: every page
was gathered through the writer's layout and is scattered through the reader's, so the outputs match.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (tox -e sglang installs sglang 0.5.23)")

from engine import P1, P2, P3, PAGE, assert_same, hicache_engine, read_record, run_sglang  # noqa: E402

from kvstrata.core.testing.server_process import ServerProcess  # noqa: E402

FLUSH = {"flush": True}
MODEL = "hicache-test-model"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(chunk_size=PAGE, l1_bytes=128 << 20) as srv:
        yield srv


def storage_loads(record: list[dict]) -> list[dict]:
    return [e for e in record if e["event"] == "load_started" and e["request_id"].startswith("hicache-get-")]


def test_storage_hits_equal_a_run_without_kvstrata_and_a_fresh_engine_in_another_layout_reads_them(work, server):
    tmp, base = work
    writer_record = tmp / "hicache-writer.jsonl"
    stored = {name: {"wait_stored": {"server_address": server.address, "model": MODEL, "tokens": p,
                                     "page_size": PAGE}} for name, p in (("P1", P1), ("P2", P2))}
    writer = run_sglang(tmp, "hicache-writer", [
        {"generate": [P1]}, {"generate": [P2]},          # 0, 1: computed, backed up to kvstrata
        stored["P1"], stored["P2"], FLUSH,               # HiCache's backup thread has stored every page
        {"generate": [P1]}, FLUSH,                       # 5: from storage
        {"generate": [P3]},                              # 7: P1's pages from storage, the rest computed
    ], hicache_engine(server.address, writer_record, "layer_first", model_name=MODEL), hicache_cpu=True)
    s = writer["steps"]
    assert_same(s[0][0], base["P1"], "P1, computed (HiCache layer_first)")
    assert_same(s[1][0], base["P2"], "P2, computed (HiCache layer_first)")
    assert s[2]["stored"]["pages"] == 12 and s[3]["stored"]["pages"] == 9, s[2:4]
    assert_same(s[5][0], base["P1"], "P1 after flush_cache, from kvstrata storage")
    assert_same(s[7][0], base["P3"], "P3, extending P1")
    assert s[5][0]["cached_tokens"] >= 12 * PAGE, s[5][0]  # P1's 12 whole pages came back
    record = read_record(writer_record)
    assert any(e["event"] == "stored" for e in record), "the writer stored nothing in kvstrata"
    assert len(storage_loads(record)) >= 12, storage_loads(record)
    assert "test-only HiCache CPU replacements installed" in writer["log"]

    reader_record = tmp / "hicache-reader.jsonl"
    reader = run_sglang(tmp, "hicache-reader", [
        {"generate": [P1]}, FLUSH, {"generate": [P2]},
    ], hicache_engine(server.address, reader_record, "page_first_direct", model_name=MODEL), hicache_cpu=True)
    r = reader["steps"]
    assert_same(r[0][0], base["P1"], "P1 in a fresh page_first_direct engine, stored by the layer_first one")
    assert_same(r[2][0], base["P2"], "P2 in a fresh page_first_direct engine")
    assert r[0][0]["cached_tokens"] >= 12 * PAGE and r[2][0]["cached_tokens"] >= 9 * PAGE, r
    events = read_record(reader_record)
    assert {e["placement"] for e in events if e["event"] == "registered"} == {"worker"}
    assert len(storage_loads(events)) >= 21, storage_loads(events)
    assert not [e for e in events if e["event"] == "load_failed"], events
