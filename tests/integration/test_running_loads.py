"""A load for a request the engine computes in the same step (``start_loads(..., running=True)``: TensorRT-LLM's
synchronous ``(n, False)`` match): layer waits cover it from the start, ``poll`` never hands it back, and its
blocks are freeable once it settled. Server placement on a real ``kvstrata serve`` held after the first slice."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from kvstrata.adapters.reference import conformance as reference
from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.adapter_api.types import HarnessSpec
from kvstrata.core.engine.scheduler_runtime import ScheduledRequest, SchedulerRuntime
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.worker_runtime import WorkerRuntime
from kvstrata.conformance_tests.slice_hold import HeldServerProcess as ServerProcess
from kvstrata.conformance_tests.slice_hold import SliceHold

from helpers import scheduler_lookup

LAYERS, BLOCKS, BS = 4, 64, 16
BOUND = 30.0




def test_a_running_load_is_waited_on_never_handed_back_and_freed_once_settled(tmp_path: Path) -> None:
    hold = SliceHold(tmp_path / "hold")
    with ServerProcess(l1_bytes=64 << 20, chunk_size=64, slice_hold=hold) as srv:
        settings = RuntimeSettings(srv.address, layers_per_slice=1, placement="server", instance_id=900)
        adapter = load_adapter("reference")
        scheduler = SchedulerRuntime(adapter, settings, model="running", block_size=BS)
        cache = reference.ReferenceCache(HarnessSpec(num_layers=LAYERS, num_blocks=BLOCKS, block_size=BS))
        runtime = WorkerRuntime(adapter, settings, model="running")
        try:
            runtime.register(cache.kv_caches)
            prompt = list(range(7000, 7000 + 128))
            src = cache.allocate(len(prompt))
            assert scheduler_lookup(scheduler, "run-store", prompt) == 0
            scheduler.allocated("run-store", src, 0)
            cache.prefill(prompt, src)
            truth = [cache.read_layer(src, layer, 128) for layer in range(LAYERS)]
            runtime.store(scheduler.plan_step([ScheduledRequest("run-store", 0, 128)], (),
                                              block_ids_of=lambda _: src).stores)
            scheduler.finished("run-store")

            hit = scheduler_lookup(scheduler, "run-load", prompt)
            assert hit == 128
            dst = cache.allocate(len(prompt))
            cache.clear(dst)
            scheduler.allocated("run-load", dst, hit)
            plan = scheduler.plan_step([], (), block_ids_of=lambda _: dst)
            hold.hold("run-load", after_slices=1)
            runtime.start_loads(plan.loads, running=True)
            hold.wait_held("run-load", BOUND)
            assert "run-load" in runtime.transfers.draining()  # waited on before any poll released it

            runtime.wait_for_layer(0)  # landed before the hold
            assert cache.read_layer(dst, 0, hit) == truth[0]
            done = threading.Event()
            threading.Thread(target=lambda: (runtime.wait_for_layer(1), done.set()), daemon=True).start()
            assert not done.wait(0.5), "the wait for layer 1 returned while layer 1 was still held on the server"
            assert runtime.poll()[1] == set(), "a running load must never be handed back"
            hold.open("run-load")
            assert done.wait(BOUND)
            for layer in range(LAYERS):
                runtime.wait_for_layer(layer)
                assert cache.read_layer(dst, layer, hit) == truth[layer]
            freeable: set = set()
            finished = ["run-load"]
            deadline = time.monotonic() + BOUND
            while "run-load" not in freeable:
                assert time.monotonic() < deadline, "the running load's blocks were never freeable"
                got, released = runtime.poll(finished)
                assert released == set()
                freeable |= got
                finished = []
                time.sleep(0.001)
            assert runtime.take_load_failures() == []
        finally:
            hold.open_all()
            runtime.close()
            scheduler.close()
            cache.close()
