"""Lookup locks belong to one engine: engines sharing a server never free each other's, whatever their ids.

TensorRT-LLM numbers its requests from 1 in every engine and vLLM takes request ids from its clients, so two
engines on one server do send the same request id. A lock owner is the request id namespaced by the rank's
registered instance id, which the server already requires to differ between engines.
"""

from __future__ import annotations

from typing import Any

import pytest
from kvstrata.adapters import reference
from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.adapter_api.types import HarnessSpec
from kvstrata.core.engine.requests import lock_owner, request_of_lock_owner
from kvstrata.core.engine.scheduler_runtime import ScheduledRequest, SchedulerRuntime
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.worker_runtime import WorkerRuntime
from kvstrata.core.wire.client import CacheClient

from helpers import scheduler_lookup

BS = 16
MODEL = "lock-owners"


@pytest.mark.parametrize("request_id", ["7", "", "a@i3", "x@i", "@i12@i", "tp@tp0/2"])
def test_an_owner_names_one_request_of_one_instance_and_gives_the_request_back(request_id: str) -> None:
    owners = {lock_owner(request_id, i) for i in (0, 3, 12, 500)}
    assert len(owners) == 4
    assert all(request_of_lock_owner(o) == request_id for o in owners)
    # "a@i3" on instance 4 and "a" on instance 3 must not meet in "a@i3@i4" vs "a@i3"
    assert lock_owner(request_id + "@i3", 4) != lock_owner(request_id, 3)




def test_an_engine_ending_its_request_leaves_the_locks_of_another_engines_request_of_the_same_id(server: Any):
    one = RuntimeSettings(server.address, instance_id=600)
    other = RuntimeSettings(server.address, instance_id=610)
    cache = reference.ReferenceCache(HarnessSpec(num_layers=2, num_blocks=32, block_size=BS))
    worker = WorkerRuntime(load_adapter("reference"), one, model=MODEL)
    schedulers = [SchedulerRuntime(load_adapter("reference"), s, model=MODEL, block_size=BS) for s in (one, other)]
    probe = CacheClient(server.address, timeout=10)
    try:
        worker.register(cache.kv_caches)
        prompt = list(range(300, 300 + 4 * BS))
        blocks = cache.allocate(len(prompt))
        cache.prefill(prompt, blocks)
        first = schedulers[0]
        assert scheduler_lookup(first, "1", prompt) == 0
        first.allocated("1", blocks, 0)
        worker.store(first.plan_step([ScheduledRequest("1", 0, len(prompt))], (), block_ids_of=lambda _: blocks).stores)
        first.finished("1")
        # Both engines now ask for their own request "2": each LOOKUP locks the hit under its own owner.
        assert [scheduler_lookup(s, "2", prompt) for s in schedulers] == [len(prompt), len(prompt)]
        schedulers[0].finished("2")  # the first engine's request ends: its END_SESSION frees its locks only
        # END_SESSION is one-way: a call on the same connection is served after it (one connection's quick
        # requests are served in the order they were sent)
        schedulers[0].client.server_info()
        assert probe.free_lookup_locks(lock_owner("2", 600)) == 0, "the first engine's locks are gone"
        assert probe.free_lookup_locks(lock_owner("2", 610)) > 0, "the other engine's locks were kept"
    finally:
        probe.close()
        for s in schedulers:
            s.close()
        worker.close()
        cache.close()
