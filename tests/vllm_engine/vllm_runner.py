"""Run a real vLLM engine on CPU, with or without kvstrata, and write what it generated as JSON.

Used by the vLLM tests as a subprocess (vLLM spawns and keeps global state, so
every run gets a fresh interpreter):

    python vllm_runner.py CONFIG.json OUT.json

CONFIG: {"model": dir, "batches": [[prompt, ...], ...], "max_tokens": 8,
         "connector": null | {kv_connector_extra_config...}, "abort": null | {...},
         "tensor_parallel_size": 1 (default) | 2,
         "barrier": null | {"directory": dir, "name": this run's, "parties": how many runs meet there}}
Each batch is one ``generate`` call (so the second batch can hit what the first stored). With a barrier,
runs started together wait for each other once their engines are up (registered), after each batch, and
before they exit, so they run at once and each batch of one runs after the other's batch before it.

With ``KVSTRATA_TEST_SLICE_HOLD`` set, the test-only slice hold is installed at import: in this process and
in every engine process vLLM starts (a forked one inherits it, a spawned one imports this module again).

With ``KVSTRATA_TEST_FAIL_FIRST_LOAD`` set (to a file path), the first load kvstrata copies in this process
(engine placement) fails before its first slice, through a test-only slice observer: a real failed
load, which vLLM recovers from by its ``kv_load_failure_policy``. The names of the loads the hook saw start
(their lock owners) go to that file, one a line.
"""

from __future__ import annotations

import json
import os
import sys
import time

from kvstrata.conformance_tests.slice_hold import (ENVIRONMENT_VARIABLE, SliceHold, add_slice_observer,
                                                   install_from_environment)

FAIL_FIRST_LOAD = "KVSTRATA_TEST_FAIL_FIRST_LOAD"
BARRIER_BOUND = 600.0
"""Seconds a run waits at a barrier for the others: only catches a run that died or hung."""


def install_first_load_failure() -> None:
    """With :data:`FAIL_FIRST_LOAD` set: the first load copied in this process fails (see the module docstring)."""
    path = os.environ.get(FAIL_FIRST_LOAD)
    if not path:
        return
    import threading

    lock = threading.Lock()

    def fail_the_first(name: str, slices: int) -> None:
        if slices != 0:
            return
        with lock:
            with open(path, "a") as f:
                first = f.tell() == 0
                f.write(name + "\n")
        if first:
            raise RuntimeError(f"load {name} fails on purpose ({FAIL_FIRST_LOAD})")

    add_slice_observer(fail_the_first)


install_from_environment()
install_first_load_failure()


def meet(barrier: dict | None, point: str) -> None:
    """Wait (bounded) until every run sharing ``barrier`` has reached ``point``."""
    if not barrier:
        return
    directory = barrier["directory"]
    open(os.path.join(directory, f"{point}.{barrier['name']}"), "w").close()
    deadline = time.monotonic() + BARRIER_BOUND
    while sum(1 for f in os.listdir(directory) if f.startswith(f"{point}.")) < barrier["parties"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other runs did not reach {point!r} within {BARRIER_BOUND:.0f}s")
        time.sleep(0.05)


def make_model(path: str) -> None:
    """This test suite's model: a random-weight float32 Llama whose outputs really depend on the KV."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: kvstrata_testing
    from kvstrata_testing.tiny_llama import write_random_llama

    write_random_llama(path, layers=8, hidden=512, heads=8, kv_heads=4)


def main(config_path: str, out_path: str) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # same thread count with and without a connector
    with open(config_path) as f:
        cfg = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if cfg.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvstrataConnector", kv_connector_module_path="kvstrata.adapters.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=cfg["connector"])
    t0 = time.monotonic()
    tp = int(cfg.get("tensor_parallel_size", 1))
    if tp > 1:
        kw.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
        # vllm-cpu binds each rank's threads to a NUMA node unless told which cores: one core per rank
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    llm = LLM(model=cfg["model"], dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=4096, max_num_seqs=8, enable_prefix_caching=False, block_size=32, seed=0, **kw)
    params = SamplingParams(max_tokens=cfg.get("max_tokens", 8), temperature=0.0, logprobs=1, ignore_eos=True)
    result = {"init_s": time.monotonic() - t0, "batches": []}
    barrier = cfg.get("barrier")
    meet(barrier, "up")
    for i, batch in enumerate(cfg["batches"]):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        result["batches"].append([
            {"tokens": list(o.outputs[0].token_ids),
             "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
            for o in outs])
        meet(barrier, f"batch-{i}")
    abort = cfg.get("abort")
    if abort:
        result["abort"] = run_abort(llm, params, abort)
    with open(out_path, "w") as f:
        json.dump(result, f)
    meet(barrier, "done")
    return 0


def run_abort(llm, params, abort: dict) -> dict:
    """Add requests through the engine API, abort one after a step or two, run the rest to the end."""
    engine = llm.llm_engine
    ids = []
    for i, prompt in enumerate(abort["prompts"]):
        rid = f"abort-test-{i}"
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        ids.append(rid)
    # step until the first request's load has started (the connector's record says so), then abort it
    record = abort.get("record_path")
    loading = False
    for _ in range(200):
        engine.step()
        if record and os.path.exists(record):
            with open(record) as f:
                loading = any('"load_started"' in line and f'"{ids[0]}' in line for line in f)
        if loading:
            break
    engine.abort_request([ids[0]])
    if os.environ.get(ENVIRONMENT_VARIABLE):
        SliceHold(os.environ[ENVIRONMENT_VARIABLE]).open("abort-test-0")  # its load may go on now
    finished = {}
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            return {"error": "engine did not finish within 120 s after the abort"}
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
                if out.request_id == ids[0]:
                    finished[out.request_id] = "aborted"
    return {"aborted": ids[0], "aborted_while_loading": loading, "finished": finished}


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        make_model(sys.argv[2])
        sys.exit(0)
    sys.exit(main(sys.argv[1], sys.argv[2]))
