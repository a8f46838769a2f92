"""Run a real SGLang 0.5.23 engine on CPU, with or without kvstrata, through a list of steps; write JSON.

Used by the SGLang tests as a subprocess (SGLang spawns its scheduler and keeps global state, so every
engine gets a fresh interpreter):

    python sglang_runner.py CONFIG.json OUT.json
    python sglang_runner.py make-model DIR

CONFIG: {"model": dir, "engine": {extra sglang.Engine arguments}, "steps": [step, ...], "max_tokens": 8,
         "shutdown": "graceful" (the default) or "kill"}
A step is one of
  {"generate": [prompt, ...], "rids": [...] (optional)}  one generate call: its outputs (or the error)
  {"flush": true}                                       flush_cache (drops SGLang's device prefix cache)
  {"kill": pid}                                         SIGKILL a process (the kvstrata server) and wait
  {"open_hold": prefix}                                 open the test-only slice hold for that prefix
  {"corrupt": {...}}                                    alter one layer of what kvstrata stored (support.py)
  {"wait_stored": {...}}                                wait until the server holds a prompt's pages (support.py)
Each generate result is a list of {"tokens", "logprobs"} or {"error": "..."} per prompt. The output also
holds "engine_pids": this process and every process the engine started (its scheduler, detokenizer, ...), for
the check that none of them left a kvstrata shared-memory segment behind, and "segments_at_shutdown": the
kvstrata segments those processes held when the shutdown began (so the check is not vacuous), and
"watchers_at_shutdown": the adapter's segment watchers of those processes then.

The KV pool's size is set, not measured: SGLang on CPU sizes it from the machine's free memory (see
``ENGINE_MEMORY``), and a test must not depend on what other processes use.

"graceful" stops the engine as SGLang's HTTP server does on SIGTERM (``TokenizerManager.sigterm_watchdog``):
a ``ShutdownReq`` to the schedulers, whose event loops end and release what they hold (SGLang closes the
kvstrata linker there, and the HiCache storage backend at the scheduler's exit), then ``Engine.shutdown`` for
the rest. "kill" is the offline ``Engine.shutdown`` alone, which SIGKILLs the schedulers: they release
nothing, and what they created is left to kvstrata's watcher (``kvstrata.adapters.sglang.reaper``).

Run with ``tests/sglang_engine/standin`` first on PYTHONPATH (the ``sgl_kernel`` import stand-in and the
test-only ``sitecustomize``), and ``SGLANG_USE_CPU_ENGINE=1``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from typing import Any

ENGINE_MEMORY = {"mem_fraction_static": 1.0, "max_total_tokens": 16384}
"""The KV pool: exactly ``max_total_tokens`` (16384 tokens, 4 KiB each here: 64 MiB), whatever memory other
processes use. SGLang 0.5.23 on CPU (``KVCacheConfigurator._profile_available_bytes``) budgets the pool as
``free memory after loading the model - free memory before it * (1 - mem_fraction_static)``, free memory being
psutil's ``available`` (``get_available_gpu_memory`` -> ``get_free_cpu_memory``), then caps it at
``max_total_tokens``. With a fraction below 1 the budget is a share of whatever the machine had free, and goes
negative ("Loaded weights leave no GPU memory for the KV cache") when other processes take that share of
memory between the two measurements (0.05 of 22 GiB is 1.1 GiB); with 1.0 nothing is held back, the budget is
all the free memory and the cap is the size (unless less than 64 MiB is free, when no engine runs anyway).
The HiCache host pool is a ratio of this (``hicache_ratio``; its own free-memory check: hicache_cpu.py)."""
SCHEDULER_EXIT_TIMEOUT = 120.0
"""How long the schedulers get to release what they hold after the ShutdownReq (a bound that only catches
a hang: each of kvstrata's shutdown waits is bounded by its own settings)."""


def make_model(path: str) -> None:
    """This test suite's model: a random-weight float32 Llama whose outputs really depend on the KV."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: kvstrata_testing
    from kvstrata_testing.tiny_llama import write_random_llama

    write_random_llama(path, layers=4, hidden=256, heads=4, kv_heads=2)


def _outputs(result: Any) -> list[dict[str, Any]]:
    out = []
    for r in result if isinstance(result, list) else [result]:
        meta = r.get("meta_info", {})
        finish = meta.get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            out.append({"error": str(finish.get("message")), "status": finish.get("status_code")})
            continue
        lps = meta.get("output_token_logprobs") or []
        out.append({"tokens": list(r["output_ids"]), "logprobs": [float(lp[0]) for lp in lps],
                    "cached_tokens": meta.get("cached_tokens")})
    return out


def main(config_path: str, out_path: str) -> int:
    with open(config_path) as f:
        cfg = json.load(f)
    import sglang

    t0 = time.monotonic()
    engine = sglang.Engine(model_path=cfg["model"], device="cpu", dtype="float32", skip_tokenizer_init=True,
                           disable_cuda_graph=True, random_seed=0, log_level="info",
                           **{"page_size": 16, **ENGINE_MEMORY, **cfg.get("engine", {})})
    params = {"max_new_tokens": cfg.get("max_tokens", 8), "temperature": 0.0, "ignore_eos": True}
    result: dict[str, Any] = {"init_s": time.monotonic() - t0, "steps": []}
    try:
        for step in cfg["steps"]:
            if "generate" in step:
                prompts = step["generate"]
                try:
                    got = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                          rid=step.get("rids"))
                    result["steps"].append(_outputs(got))
                except Exception as exc:  # a failed request may surface as an exception: keep it as the result
                    result["steps"].append([{"error": f"{type(exc).__name__}: {exc}"}] * len(prompts))
            elif "flush" in step:
                result["steps"].append({"flushed": bool(engine.flush_cache().success)})
            elif "kill" in step:
                os.kill(int(step["kill"]), signal.SIGKILL)
                result["steps"].append({"killed": step["kill"]})
            elif "open_hold" in step:
                from kvstrata.conformance_tests.slice_hold import (
                    ENVIRONMENT_VARIABLE,
                    SliceHold,
                )

                SliceHold(os.environ[ENVIRONMENT_VARIABLE]).open(step["open_hold"])
                result["steps"].append({"opened": step["open_hold"]})
            elif "wait_stored" in step:
                import support

                result["steps"].append({"stored": support.wait_stored(**step["wait_stored"])})
            elif "corrupt" in step:
                import support

                result["steps"].append({"corrupted": support.corrupt_stored_layer(**step["corrupt"])})
            else:
                raise ValueError(f"unknown step {step!r}")
    finally:
        result["engine_pids"], result["segments_at_shutdown"], result["watchers_at_shutdown"] = shutdown(
            engine, graceful=cfg.get("shutdown", "graceful") == "graceful")
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


def shutdown(engine: Any, *, graceful: bool) -> tuple[list[int], list[str], list[int]]:
    """Stop the engine (``graceful``: as SGLang's HTTP server does on SIGTERM); the pids of every process it
    ran, and the kvstrata segments and segment watchers they had when the shutdown began.

    ``TokenizerManager.sigterm_watchdog`` sends a ``ShutdownReq`` to the schedulers, waits for them to exit,
    then kills what is left. The offline ``Engine.shutdown`` (all that runs when not ``graceful``) skips the
    first two steps: it SIGKILLs the schedulers, so nothing in them (SGLang's ``release_host_resources``, its
    ``atexit`` hooks) ever runs.
    """
    import psutil
    from kvstrata.adapters.sglang.reaper import watchers_of
    from sglang.srt.managers.io_struct import ShutdownReq
    from sglang.srt.utils.cudacore_pyspy_dump_utils import collect_scheduler_processes

    me = psutil.Process()
    pids = [me.pid] + [p.pid for p in me.children(recursive=True)]
    ours = re.compile(r"^kvstrata-.+-(\d+)-[0-9a-f]{8}$")
    held = sorted(n for n in os.listdir("/dev/shm") if (m := ours.match(n)) and int(m.group(1)) in pids)
    watchers = watchers_of(pids)
    try:
        if not graceful:
            return pids, held, watchers
        schedulers = collect_scheduler_processes()
        if not schedulers:
            raise RuntimeError(f"no sglang::scheduler process among the engine's processes {pids}")
        engine.tokenizer_manager._dispatch_to_scheduler(ShutdownReq())
        _, alive = psutil.wait_procs(schedulers, timeout=SCHEDULER_EXIT_TIMEOUT)
        if alive:
            print(f"schedulers {[p.pid for p in alive]} still alive {SCHEDULER_EXIT_TIMEOUT:.0f}s after the "
                  "ShutdownReq; Engine.shutdown kills them", file=sys.stderr, flush=True)
    finally:
        engine.shutdown()
    return pids, held, watchers


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        make_model(sys.argv[2])
        sys.exit(0)
    sys.exit(main(sys.argv[1], sys.argv[2]))
