"""Run a real SGLang 0.5.23 engine on CPU, with or without kvstrata, through a list of steps; write JSON.

Used by the SGLang tests as a subprocess (SGLang spawns its scheduler and keeps global state, so every
engine gets a fresh interpreter):

    python sglang_runner.py CONFIG.json OUT.json
    python sglang_runner.py make-model DIR

CONFIG: {"model": dir, "engine": {extra sglang.Engine arguments}, "steps": [step, ...], "max_tokens": 8}
A step is one of
  {"generate": [prompt, ...], "rids": [...] (optional)}  one generate call: its outputs (or the error)
  {"flush": true}                                       flush_cache (drops SGLang's device prefix cache)
  {"kill": pid}                                         SIGKILL a process (the kvstrata server) and wait
  {"open_hold": prefix}                                 open the test-only slice hold for that prefix
  {"corrupt": {...}}                                    alter one layer of what kvstrata stored (support.py)
  {"wait_stored": {...}}                                wait until the server holds a prompt's pages (support.py)
Each generate result is a list of {"tokens", "logprobs"} or {"error": "..."} per prompt.

Run with ``tests/sglang_engine/standin`` first on PYTHONPATH (the ``sgl_kernel`` import stand-in and the
test-only ``sitecustomize``), and ``SGLANG_USE_CPU_ENGINE=1``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any


def make_model(path: str) -> None:
    """This test suite's model: a random-weight float32 Llama whose outputs really depend on the KV."""
    from kvstrata.core.testing.tiny_llama import write_random_llama

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
    engine = sglang.Engine(model_path=cfg["model"], device="cpu", dtype="float32", page_size=16,
                           skip_tokenizer_init=True, mem_fraction_static=0.05, max_total_tokens=16384,
                           disable_cuda_graph=True, random_seed=0, log_level="info", **cfg.get("engine", {}))
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
                from kvstrata.core.testing.slice_hold import (
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
        engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        make_model(sys.argv[2])
        sys.exit(0)
    sys.exit(main(sys.argv[1], sys.argv[2]))
