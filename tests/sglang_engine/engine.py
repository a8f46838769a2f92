"""Running the SGLang runner as a subprocess from the tests: the environment, the model, the comparisons."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvstrata.adapters.sglang.reaper import watchers_of
from kvstrata.conformance_tests.slice_hold import ENVIRONMENT_VARIABLE, SliceHold

HERE = Path(__file__).parent
RUNNER = HERE / "sglang_runner.py"
STANDIN = HERE / "standin"
PAGE = 16
LAYERS, KV_HEADS, HEAD_SIZE = 4, 2, 64  # the runner's make_model: hidden 256, 4 heads, 2 KV heads
TOL = 1e-4  # float32 on CPU; the same prompt alone and in a batch agrees to ~1e-6
LINKER = {"linker": "KvstrataLinker", "linker_module_path": "kvstrata.adapters.sglang.linker"}
CALLS_ENV = "KVSTRATA_TEST_SGL_KERNEL_CALLS"

_rng = random.Random(7)
P1 = [_rng.randrange(3, 999) for _ in range(200)]  # 12 whole pages
P2 = [_rng.randrange(3, 999) for _ in range(150)]  # 9 whole pages
P3 = P1 + [_rng.randrange(3, 999) for _ in range(70)]  # extends P1: its 12 pages load, the rest is computed
P4 = [_rng.randrange(3, 999) for _ in range(120)]  # 7 whole pages, first computed by a page_first HiCache engine
P5 = [_rng.randrange(3, 999) for _ in range(100)]  # 6 whole pages, first computed through the linker
P6 = [_rng.randrange(3, 999) for _ in range(90)]  # 5 whole pages, first computed through HiCache
PROMPTS = {"P1": P1, "P2": P2, "P3": P3, "P4": P4, "P5": P5, "P6": P6}


def engine_env(tmp: Path, name: str, *, slice_hold: SliceHold | None = None, hicache_cpu: bool = False
               ) -> dict[str, str]:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(STANDIN), str(HERE), os.environ.get("PYTHONPATH", "")]))
    env[CALLS_ENV] = str(tmp / f"{name}-sgl-kernel-calls")
    env.pop(ENVIRONMENT_VARIABLE, None)
    env.pop("KVSTRATA_TEST_SGLANG_HICACHE_CPU", None)
    if slice_hold is not None:
        env[ENVIRONMENT_VARIABLE] = str(slice_hold.directory)
    if hicache_cpu:
        env["KVSTRATA_TEST_SGLANG_HICACHE_CPU"] = "1"
    return env


def make_model(path: Path) -> None:
    subprocess.run([sys.executable, str(RUNNER), "make-model", str(path)], check=True, capture_output=True,
                   timeout=300, env=engine_env(path.parent, "make-model"))


def run_sglang(tmp: Path, name: str, steps: list[dict[str, Any]], engine: dict[str, Any] | None = None, *,
               slice_hold: SliceHold | None = None, hicache_cpu: bool = False, timeout: float = 600,
               shutdown: str = "graceful") -> dict:
    """One engine, a fresh interpreter, through ``steps``; fails the test if the stand-in kernel was called, or
    if a process of the engine left a kvstrata shared-memory segment behind once it exited (the runner's
    processes have all exited when it returns: it waits for the schedulers, ``Engine.shutdown`` for the rest).
    ``shutdown="kill"``: the offline ``Engine.shutdown`` alone, which SIGKILLs the schedulers; their segments are
    then the adapter's watchers' to remove: each exits once it has, and the check waits (bounded) for that."""
    cfg = {"model": str(tmp / "model"), "engine": engine or {}, "steps": steps, "max_tokens": 8,
           "shutdown": shutdown}
    (tmp / f"{name}.json").write_text(json.dumps(cfg))
    env = engine_env(tmp, name, slice_hold=slice_hold, hicache_cpu=hicache_cpu)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(RUNNER), str(tmp / f"{name}.json"), str(tmp / f"{name}.out")],
                          capture_output=True, text=True, timeout=timeout, env=env)
    log = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(log)
    assert proc.returncode == 0, f"SGLang run {name} failed:\n{log[-6000:]}"
    calls = Path(env[CALLS_ENV])
    assert not calls.exists(), f"SGLang run {name} called the sgl_kernel stand-in: {sorted(os.listdir(calls))}"
    out = json.loads((tmp / f"{name}.out").read_text())
    if shutdown != "graceful":
        assert watchers_done(out["engine_pids"], timeout=SEGMENT_WATCH_BOUND), \
            f"SGLang run {name}: a segment watcher did not finish once the engine had exited"
    left = segments_of(out["engine_pids"])
    assert not left, f"SGLang run {name}: its processes left kvstrata shared-memory segments behind: {left}"
    if with_kvstrata(engine):  # kvstrata's engines hold segments until their shutdown: the check above saw them go
        assert out["segments_at_shutdown"], f"SGLang run {name}: no kvstrata segment existed at its shutdown"
        assert out["watchers_at_shutdown"], f"SGLang run {name}: no segment watcher ran for its scheduler"
        # gracefully, SGLang's shutdown closed the adapter (the watcher only removes a killed engine's segments)
        closed = re.search(r"kvstrata (SGLang linker|HiCache backend) closed", log)
        assert bool(closed) == (shutdown == "graceful"), \
            f"SGLang run {name} ({shutdown} shutdown): the adapter was {'' if closed else 'not '}closed"
    out["wall_s"] = time.monotonic() - started
    out["log"] = log
    return out


def with_kvstrata(engine: dict[str, Any] | None) -> bool:
    """Whether SGLang engine arguments ``engine`` plug kvstrata in (the linker or the HiCache backend)."""
    return bool(engine) and ("unified_cache_external_linker_config" in engine
                             or "hicache_storage_backend_extra_config" in engine)


SHM_DIR = Path("/dev/shm")
SEGMENT = re.compile(r"^kvstrata-.+-(\d+)-[0-9a-f]{8}$")
"""A kvstrata segment's name: ``kvstrata-<kind>-<creator's pid>-<random>`` (``kvstrata.core.shm``)."""


def segments_of(pids: list[int]) -> list[str]:
    """The kvstrata shared-memory segments that processes ``pids`` created and that still exist."""
    pids = set(pids)
    return sorted(n for n in os.listdir(SHM_DIR) if (m := SEGMENT.match(n)) and int(m.group(1)) in pids)


SEGMENT_WATCH_BOUND = 60.0
"""How long a killed engine's segment watchers may take to finish (each wakes when its process has exited;
the bound only catches one that never does)."""


def watchers_done(pids: list[int], *, timeout: float) -> bool:
    """Wait (bounded) until no segment watcher of ``pids`` runs: each exits once it has removed its process's
    segments, so what is left then stays. Checked as soon as they are done, what is gone is their work, not
    a later sweep by a kvstrata server starting up (which removes dead processes' segments too)."""
    deadline = time.monotonic() + timeout
    while watchers_of(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not watchers_of(pids)


def linker_engine(server_address: str, record: Path, **settings: Any) -> dict[str, Any]:
    extra = {"server_address": server_address, "layers_per_slice": 1, "record_path": str(record),
             "lookup_timeout": 2.0, "layer_wait_timeout": 5.0, **settings}
    return {"enable_unified_cache_external_linker": True, "unified_cache_external_linker_backend": "dynamic",
            "unified_cache_external_linker_config": {**LINKER, "linker_extra_config": extra}}


def assert_same(got: dict, want: dict, what: str) -> None:
    assert "error" not in got, f"{what}: the request failed: {got['error']}"
    assert got["tokens"] == want["tokens"], f"{what}: tokens {got['tokens']} != {want['tokens']}"
    diff = max(abs(x - y) for x, y in zip(got["logprobs"], want["logprobs"], strict=True))
    assert diff < TOL, f"{what}: logprobs differ by {diff}"


def read_record(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def hicache_engine(server_address: str, record: Path, layout: str, io_backend: str = "direct",
                   **settings: Any) -> dict[str, Any]:
    """SGLang's HiCache with kvstrata's storage backend (v1 zero-copy), host layout ``layout``, IO backend
    ``io_backend`` (``direct`` for ``layer_first`` / ``page_first_direct``, ``kernel`` for ``page_first``, which
    SGLang would otherwise turn into ``page_first_direct``; hicache_cpu.py replaces the copies each calls), and
    prefetches that wait until they complete (the hits must not depend on how fast this machine is)."""
    extra = {"backend_name": "kvstrata", "module_path": "kvstrata.adapters.sglang.hicache",
             "class_name": "KvstrataHiCacheStorage", "interface_v1": 1, "prefetch_threshold": PAGE,
             "server_address": server_address, "record_path": str(record), **settings}
    return {"enable_hierarchical_cache": True, "hicache_mem_layout": layout, "hicache_io_backend": io_backend,
            "hicache_ratio": 2.0, "hicache_storage_backend": "dynamic",
            "hicache_storage_prefetch_policy": "wait_complete",
            "hicache_storage_backend_extra_config": json.dumps(extra)}
