"""What an operator sees: the Prometheus endpoint, `kvstrata status`, `kvstrata --version` and config files."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.core.arrival.board import ArrivalBoard
from kvstrata.core.engine.server_placement import ServerPlacement
from kvstrata.core.store.keys import CacheKey
from kvstrata.adapters.reference.engine import ReferenceEngine
from kvstrata.server_process import ServerProcess
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.transport import RemoteError

from helpers import SMALL_32, engine_loop, lookup_into_fresh_blocks, random_prompt, store_prompt


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def metered():
    with ServerProcess(l1_bytes=64 << 20, chunk_size=64, extra_args=["--metrics-port", "0"]) as srv:
        client = CacheClient(srv.address, timeout=20)
        yield srv, client, client.server_info()["metrics_port"]
        client.close()


def test_counters_match_what_was_stored_looked_up_and_retrieved(metered) -> None:
    srv, client, port = metered
    engine = ReferenceEngine(SMALL_32, num_blocks=32, block_size=16)
    worker = ServerPlacement(client, 0, engine.layout)
    per_token = engine.layout.object_bytes(1)
    try:
        worker.register()
        before = scrape(port)
        prompt = random_prompt(192, seed=11)
        store_prompt(client, engine, prompt)  # 192 tokens stored
        key, dst = lookup_into_fresh_blocks(client, engine, "m1", prompt)  # 192 tokens hit
        worker.submit_retrieve("m1", key, [dst], layers_per_slice=1)
        engine_loop(worker, "m1", SMALL_32.num_layers)
        miss = CacheKey.for_tokens("m2", random_prompt(128, seed=12), model="m")
        assert client.lookup(miss) == 0  # 128 tokens missed
        client.free_lookup_locks("m2")
        after = scrape(port)

        def delta(name: str, **labels: str) -> float:
            k = (name, tuple(sorted(labels.items())))
            return after.get(k, 0.0) - before.get(k, 0.0)

        assert delta("kvstrata_stored_tokens_total") == 192
        assert delta("kvstrata_stored_bytes_total") == 192 * per_token
        assert delta("kvstrata_lookup_hit_tokens_total") == 192
        assert delta("kvstrata_lookup_miss_tokens_total") == 128
        assert delta("kvstrata_retrieved_tokens_total") == 192
        assert delta("kvstrata_retrieved_bytes_total") == 192 * per_token
        assert delta("kvstrata_retrieve_seconds_count") == 1 and delta("kvstrata_store_seconds_count") == 1
        assert after[("kvstrata_registered_instances", ())] == 1
        assert after[("kvstrata_l1_used_bytes", ())] == 192 * per_token
        assert after[("kvstrata_l1_used_bytes", ())] + after[("kvstrata_l1_free_bytes", ())] == 64 << 20
        assert after[("kvstrata_transfers_in_flight", ())] == 0
        assert after[("kvstrata_lookup_locked_objects", ())] == 0
    finally:
        worker.close()
        engine.close()


def test_a_fallback_and_a_failure_are_counted_by_reason_and_kind(metered) -> None:
    srv, client, port = metered
    engine = ReferenceEngine(SMALL_32, num_blocks=16, block_size=16)
    hybrid = dataclasses.replace(engine.layout, layer_groups=(tuple(range(16)), tuple(range(16, 32))))
    board = ArrivalBoard.create(1)
    try:
        client.register_kv_cache(3, hybrid, "server")
        prompt = random_prompt(64, seed=13)
        blocks = engine.allocate(64)
        engine.prefill(prompt, blocks)
        client.store(CacheKey.for_tokens("fs", prompt, model="m"), 3, [blocks, blocks])
        before = scrape(port)
        key = CacheKey.for_tokens("fallback", prompt, model="m")
        client.lookup(key)
        reply = client.retrieve(key, 3, [blocks, blocks], arrival_board={"name": board.name, "slot": 0,
                                                                          "generation": 1}, layers_per_slice=1)
        with pytest.raises(RemoteError) as err:
            client.retrieve(CacheKey.for_tokens("nope", prompt, model="m"), 99, [blocks])
        assert err.value.code == "unknown_instance"
        after = scrape(port)
        reason = reply["fallback"]
        assert reason and after[("kvstrata_fallbacks_total", (("reason", reason),))] - \
            before.get(("kvstrata_fallbacks_total", (("reason", reason),)), 0) == 1
        failed = ("kvstrata_failures_total", (("code", "unknown_instance"), ("request", "RETRIEVE")))
        assert after[failed] - before.get(failed, 0) == 1
    finally:
        client.unregister_kv_cache(3)
        board.destroy()
        engine.close()


def kvstrata(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstrata", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_status_shows_a_live_server_and_fails_clearly_without_one(metered, tmp_path: Path) -> None:
    srv, client, port = metered
    shown = kvstrata("status", "--address", srv.address)
    assert shown.returncode == 0, shown.stderr
    for text in ("kvstrata 0.1.0 at " + srv.address, "L1 pool", "64 MiB", "chunk size", "64 tokens", "hit rate",
                 f"http://127.0.0.1:{port}/metrics", "instances"):
        assert text in shown.stdout, (text, shown.stdout)
    as_json = json.loads(kvstrata("status", "--address", srv.address, "--json").stdout)
    assert as_json["chunk_size"] == 64 and as_json["metrics_port"] == port
    missing = kvstrata("status", "--address", f"ipc://{tmp_path}/nobody.sock", "--timeout", "1")
    assert missing.returncode == 1
    assert f"no kvstrata server answered at ipc://{tmp_path}/nobody.sock" in missing.stderr
    version = kvstrata("--version")
    assert version.returncode == 0 and version.stdout.strip() == "kvstrata 0.1.0"


def test_config_file_sets_the_server_and_flags_override_it(tmp_path: Path) -> None:
    config = tmp_path / "kvstrata.toml"
    config.write_text('[serve]\nl1_size = "32M"\nchunk_size = 128\ntransfer_threads = 2\n')
    address = f"ipc://{tmp_path}/configured.sock"
    proc = subprocess.Popen([sys.executable, "-m", "kvstrata", "serve", "--config", str(config), "--address", address,
                             "--chunk-size", "32"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    c = CacheClient(address, timeout=60)
    try:
        info = c.server_info()  # waits (bounded) for the server to come up
    finally:
        c.close()
        proc.terminate()
        log = proc.communicate(timeout=60)[0]
    assert info["pool"]["size"] == 32 << 20  # from the file
    assert info["chunk_size"] == 32  # the flag wins over the file
    assert f"settings from {config}" in log and "transfer_threads=2" in log and "chunk_size=32" in log, log


def test_a_yaml_config_file_is_read_too(tmp_path: Path) -> None:
    from kvstrata.server_config import read_config

    config = tmp_path / "kvstrata.yaml"
    config.write_text("serve:\n  l1_size: 2G\n  chunk_size: 512\n  allow_remote: false\n")
    assert read_config(str(config)) == {"l1_size": 2 << 30, "chunk_size": 512, "allow_remote": False}


@pytest.mark.parametrize("body, message", [
    ('chunk_sise = 128\n', "unknown setting 'chunk_sise'"),
    ('l1_size = "lots"\n', "l1_size = 'lots' is not a size"),
    ('metrics_port = 70000\n', "metrics_port = 70000 is not an integer in [0, 65535]"),
    ('allow_remote = "yes"\n', "allow_remote = 'yes' is not true or false"),
])
def test_a_bad_config_file_is_refused_naming_the_key(tmp_path: Path, body: str, message: str) -> None:
    config = tmp_path / "kvstrata.toml"
    config.write_text(body)
    result = kvstrata("serve", "--config", str(config), "--address", f"ipc://{tmp_path}/s.sock")
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_transfer_is_counted_when_its_handler_answers(inprocess_server) -> None:
    """A transfer's outcome, tokens, fallback and time are counted when its handler returns, and its failure
    when it raises."""
    from kvstrata.core.server.metrics import ServerMetrics
    from kvstrata.core.wire.protocol import RequestType

    metrics = ServerMetrics(inprocess_server)
    key = CacheKey.for_tokens("d", list(range(64)), model="m").to_wire()

    def retrieve(key, instance_id, block_ids, event_handle, skip_first_n_tokens, arrival_board,
                 layer_event_handles, layers_per_slice):
        return {"retrieved_tokens": 64, "fallback": "why not"}

    def failing(key, instance_id, block_ids, event_handle, skip_first_n_tokens):
        raise RuntimeError("the device failed")

    assert metrics.totals()["retrieved_tokens"] == 0
    reply = metrics.instrument(RequestType.RETRIEVE, retrieve)(key, 0, [[0]], None, 0, None, None, 1)
    assert reply["retrieved_tokens"] == 64
    assert metrics.totals()["retrieved_tokens"] == 64 and metrics._fallbacks == {"why not": 1}
    assert metrics._hists["retrieve_seconds"].counts != [0] * len(metrics._hists["retrieve_seconds"].counts)
    with pytest.raises(RuntimeError):
        metrics.instrument(RequestType.STORE, failing)(key, 0, [[0]], None, 0)
    assert metrics._failures == {("STORE", "error"): 1}
