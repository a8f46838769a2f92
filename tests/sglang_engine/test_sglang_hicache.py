"""kvstrata's HiCache storage backend inside a real SGLang 0.5.23 engine on CPU, against a real server.

HiCache on CPU needs its CUDA-only calls replaced in the engine's processes (hicache_cpu.py says which and
why; nothing of kvstrata's is replaced). The ``layer_first`` and ``page_first_direct`` host layouts run with
the ``direct`` IO backend, ``page_first`` with the ``kernel`` one (SGLang turns ``page_first`` + ``direct``
into ``page_first_direct``), whose two sgl_kernel copies hicache_cpu.py replaces with torch indexing.

Three engines, one server. A writer in ``layer_first`` computes prompts and backs them up to kvstrata; after
``flush_cache`` its hits come from storage. A fresh engine in ``page_first`` reads what the writer stored,
computes a new prompt, backs it up through its own layout and, after ``flush_cache``, gets it back from
storage. A fresh engine in ``page_first_direct`` reads what both stored. Every page is gathered through its
writer's layout and scattered through its reader's, so all outputs equal a run without kvstrata. Each engine
stops as SGLang's HTTP server stops it (a ``ShutdownReq``; SGLang closes the storage backend at the scheduler's
exit), and leaves no kvstrata shared-memory segment behind (engine.py's ``run_sglang`` checks).
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (tox -e sglang installs sglang 0.5.23)")

from engine import P1, P2, P3, P4, PAGE, assert_same, hicache_engine, read_record, run_sglang  # noqa: E402

from kvstrata.server_process import ServerProcess  # noqa: E402

FLUSH = {"flush": True}
MODEL = "hicache-test-model"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(chunk_size=PAGE, l1_bytes=128 << 20) as srv:
        yield srv


def storage_loads(record: list[dict]) -> list[dict]:
    return [e for e in record if e["event"] == "load_started" and e["request_id"].startswith("hicache-get-")]


def test_storage_hits_equal_a_run_without_kvstrata_and_fresh_engines_in_other_layouts_read_them(work, server):
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
    assert {e["located_by"] for e in storage_loads(record)} == {"lookup"}, "every page load starts from its LOOKUP"
    assert "test-only HiCache CPU replacements installed" in writer["log"]

    pf_record = tmp / "hicache-page-first.jsonl"
    page_first = run_sglang(tmp, "hicache-page-first", [
        {"generate": [P1]},                              # 0: from storage, stored by the layer_first writer
        {"generate": [P4]},                              # 1: computed, backed up through page_first
        {"wait_stored": {"server_address": server.address, "model": MODEL, "tokens": P4, "page_size": PAGE}},
        FLUSH,
        {"generate": [P4]},                              # 4: from storage, stored by this engine
    ], hicache_engine(server.address, pf_record, "page_first", io_backend="kernel", model_name=MODEL),
        hicache_cpu=True)
    f = page_first["steps"]
    assert "host layout page_first, " in page_first["log"], "the engine did not run the page_first host layout"
    for op in ("transfer_kv_all_layer_lf_pf", "transfer_kv_per_layer_pf_lf"):  # backup, load
        assert f"test-only CPU replacement {op} called" in page_first["log"], op
    assert_same(f[0][0], base["P1"], "P1 in a fresh page_first engine, stored by the layer_first one")
    assert_same(f[1][0], base["P4"], "P4, computed (HiCache page_first)")
    assert f[2]["stored"]["pages"] == 7, f[2]
    assert_same(f[4][0], base["P4"], "P4 after flush_cache, from kvstrata storage (stored page_first)")
    assert f[0][0]["cached_tokens"] >= 12 * PAGE and f[4][0]["cached_tokens"] >= 7 * PAGE, f
    events = read_record(pf_record)
    assert len(storage_loads(events)) >= 19, storage_loads(events)
    assert not [e for e in events if e["event"] == "load_failed"], events

    reader_record = tmp / "hicache-reader.jsonl"
    reader = run_sglang(tmp, "hicache-reader", [
        {"generate": [P1]}, FLUSH, {"generate": [P2]}, FLUSH, {"generate": [P4]},
    ], hicache_engine(server.address, reader_record, "page_first_direct", model_name=MODEL), hicache_cpu=True)
    r = reader["steps"]
    assert "host layout page_first_direct, " in reader["log"]
    assert_same(r[0][0], base["P1"], "P1 in a fresh page_first_direct engine, stored by the layer_first one")
    assert_same(r[2][0], base["P2"], "P2 in a fresh page_first_direct engine")
    assert_same(r[4][0], base["P4"], "P4 in a fresh page_first_direct engine, stored by the page_first one")
    assert r[0][0]["cached_tokens"] >= 12 * PAGE and r[2][0]["cached_tokens"] >= 9 * PAGE, r
    assert r[4][0]["cached_tokens"] >= 7 * PAGE, r[4]
    events = read_record(reader_record)
    assert {e["placement"] for e in events if e["event"] == "registered"} == {"engine"}
    assert len(storage_loads(events)) >= 28, storage_loads(events)
    assert not [e for e in events if e["event"] == "load_failed"], events
