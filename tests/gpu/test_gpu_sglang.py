"""The SGLang linker's copy path on a GPU, against SGLang-shaped CUDA buffers (SGLang itself does not install
on the GPU machine: it pins torch 2.14.1, the image has 2.11).

What runs is exactly what ``KvstrataLinker`` runs: :class:`kvstrata.adapters.sglang.loader.LayerLoader` over a
``WorkerRuntime`` with the SGLang adapter's hooks (engine placement: this process copies from the server's L1
pool into its own CUDA buffers), SGLang's per-layer ``k_buffer`` / ``v_buffer`` (or MLA's ``kv_buffer``)
``[slots, heads, head_dim]`` tensors on cuda, SGLang-style page-hash keys and token slots. SGLang's
``LayerWiseLoadCounter`` is replaced by :class:`LoadCounter`, a stand-in with its semantics (one future per
layer; ``wait_until`` blocks the CPU; ``finish`` says whether every layer landed), which additionally checks,
when a layer is completed, that the layer's bytes are already in place.

"No layer completed before its copy's event" is checked with a test-only gate, not with timing: the copy
stream is made to wait on a device word (``cuStreamWaitValue32``) that only the test sets, so every copy is
enqueued but none can run; no layer may be completed then, and all are once the test opens the gate.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from concurrent.futures import Future

import pytest
import torch

from kvstrata.adapters.sglang import hooks as sglang_hooks
from kvstrata.adapters.sglang.kv_layout import SglangKVBuffers
from kvstrata.adapters.sglang.loader import LayerLoader
from kvstrata.core.adapter_api.plugins import load_adapter
from kvstrata.core.engine.settings import RuntimeSettings
from kvstrata.core.engine.worker_runtime import WorkerRuntime

PAGE, LAYERS, HEADS, HEAD = 16, 8, 4, 64
PAGES = 32  # per prompt
SRC = list(range(1, 1 + PAGES))
DST = list(range(1 + PAGES, 1 + 2 * PAGES))
BOUND = 60.0  # only catches hangs


class LoadCounter:
    """SGLang 0.5.23's ``LayerWiseLoadCounter`` (``sglang/srt/mem_cache/unified_cache/unified_cache_linker.py``):
    the same names and meaning, one ``Future`` per layer per producer index. ``check(layer)``, if given, runs
    at ``complete`` and must find the layer's bytes in place; a violation is kept for the test."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.producer_index = -1
        self.consumer_index = -1
        self.futures: dict[int, list[Future]] = {}
        self.check = None
        self.violations: list[str] = []

    def update_producer(self) -> int:
        self.producer_index += 1
        self.futures[self.producer_index] = [Future() for _ in range(self.num_layers)]
        return self.producer_index

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def complete(self, index: int, layer: int) -> None:
        if self.check is not None and not self.check(layer):
            self.violations.append(f"layer {layer} completed before its bytes were in place")
        self.futures[index][layer].set_result(None)

    def fail(self, index: int, error: BaseException) -> None:
        for future in self.futures.get(index, ()):
            if not future.done():
                future.set_exception(error)

    def wait_until(self, threshold: int) -> None:
        futures = self.futures.get(self.consumer_index)
        if futures is not None:
            futures[threshold].exception(timeout=BOUND)

    def finish(self, index: int) -> bool:
        futures = self.futures.get(index)
        if futures is None:
            return True
        landed = all(f.exception(timeout=BOUND) is None for f in futures)
        del self.futures[index]
        return landed

    def reset(self) -> None:
        self.producer_index = self.consumer_index = -1
        self.futures.clear()


def chain(seed: str, n: int) -> list[str]:
    out, prev = [], seed.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + str(i).encode()).digest()
        out.append(prev.hex())
    return out


def slots(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).to("cuda")


def buffers(mla: bool) -> SglangKVBuffers:
    n = (1 + 2 * PAGES + 1) * PAGE
    if mla:
        return SglangKVBuffers(tuple(torch.zeros(n, 1, 576, dtype=torch.bfloat16, device="cuda")
                                     for _ in range(LAYERS)), None, PAGE)
    def planes() -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(n, HEADS, HEAD, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS))

    return SglangKVBuffers(planes(), planes(), PAGE)


@pytest.fixture(scope="module", params=["mha", "mla"])
def engine(request, gpu_server, tmp_path_factory):
    mla = request.param == "mla"
    kv = buffers(mla)
    idx = slots(SRC)
    for t in kv.planes():
        t[idx] = torch.randn(len(idx), *t.shape[1:], device="cuda").to(t.dtype)
    truth = [t[idx].clone() for t in kv.planes()]
    settings = RuntimeSettings.from_mapping({
        "server_address": gpu_server.address, "layers_per_slice": 1, "placement": "engine",
        "instance_id": 70 + mla, "layer_wait_timeout": 10.0,
        "record_path": str(tmp_path_factory.mktemp("sglang-gpu") / "record.jsonl")}, where="test")
    runtime = WorkerRuntime(load_adapter(sglang_hooks, check_engine=False), settings, model=f"sglang-gpu-{mla}")
    runtime.register(kv)
    assert runtime.connected and runtime.placement == "engine" and runtime.description.device.startswith("cuda")
    counter = LoadCounter(LAYERS)
    loader = LayerLoader(runtime, counter, page_size=PAGE,
                         wait_for_offload_inputs=lambda events: torch.cuda.synchronize())
    hashes = chain(request.param, PAGES)
    loader.offload(hashes, slots(SRC))  # SGLang's offload of a computed node
    deadline = time.monotonic() + BOUND
    while loader.num_completed_offloads() == 0:
        assert time.monotonic() < deadline, "the offload never completed"
        time.sleep(0.001)
    assert loader.pop_completed_offload() is True
    yield kv, loader, counter, hashes, truth
    loader.close()


def clear_dst(kv: SglangKVBuffers) -> None:
    idx = slots(DST)
    for t in kv.planes():
        t[idx] = 0
    torch.cuda.synchronize()


def dst_equal(kv: SglangKVBuffers, truth: list[torch.Tensor], plane: int | None = None) -> bool:
    idx = slots(DST)
    planes = range(len(truth)) if plane is None else [plane]
    return all(torch.equal(kv.planes()[p][idx].view(torch.int16), truth[p].view(torch.int16)) for p in planes)


def run_load(loader: LayerLoader, counter: LoadCounter, rid: str, hashes: list[str]) -> int:
    """SGLang's init_load_back + start_layer_wise_loading; returns the counter index."""
    assert loader.queue_load(rid, hashes, slots(DST)) is True
    index = loader.start()
    assert index >= 0
    return index


def test_every_layer_lands_byte_exact_in_sglang_shaped_cuda_buffers(engine) -> None:
    kv, loader, counter, hashes, truth = engine
    clear_dst(kv)
    assert not dst_equal(kv, truth)
    index = run_load(loader, counter, "sglang-gpu-exact", hashes)
    counter.set_consumer(index)  # the TP worker, before the forward
    for layer in range(LAYERS):  # the attention of each layer
        counter.wait_until(layer)
    assert loader.finish(index) is True  # after the forward: every layer landed
    torch.cuda.synchronize()
    assert dst_equal(kv, truth)
    loader.drain()


def gate_stream(stream: torch.cuda.Stream, word: torch.Tensor) -> None:
    """Make ``stream`` wait until the int32 device ``word`` equals 1 (CUDA stream memory op)."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    fn.restype = ctypes.c_int
    cu_stream_wait_value_eq = 0x1
    rc = fn(ctypes.c_void_p(stream.cuda_stream), ctypes.c_uint64(word.data_ptr()), 1, cu_stream_wait_value_eq)
    if rc != 0:
        pytest.skip(f"cuStreamWaitValue32 is not available on this device/driver (CUresult {rc}): no copy gate")


def test_no_layer_is_completed_before_its_copy_ran(engine) -> None:
    kv, loader, counter, hashes, truth = engine
    test_every_layer_lands_byte_exact_in_sglang_shaped_cuda_buffers(engine)  # maps the pool: the copier exists
    clear_dst(kv)
    nk = LAYERS
    planes_of = (lambda layer: [layer, nk + layer]) if kv.v is not None else (lambda layer: [layer])
    check_stream = torch.cuda.Stream()

    def in_place(layer: int) -> bool:  # read on a stream not ordered after the copies: what memory holds now
        with torch.cuda.stream(check_stream):
            return all(dst_equal(kv, truth, p) for p in planes_of(layer))

    counter.check = in_place
    copier = loader.runtime.transfers._copier
    word = torch.zeros(1, dtype=torch.int32, device="cuda")
    gate_stream(copier.engine.stream, word)
    try:
        index = run_load(loader, counter, "sglang-gpu-gated", hashes)
        # the first slice is enqueued behind the gate (the transfer thread records its event as it enqueues
        # it) and the load is released on it: a loader that completed a layer without its event would now
        transfers = loader.runtime.transfers
        deadline = time.monotonic() + BOUND
        while True:
            inf = transfers._inflight.get("sglang-gpu-gated")
            if inf is not None and inf.gate.arrived_layers >= 1:
                break
            assert time.monotonic() < deadline, "the first slice was never enqueued"
            time.sleep(0.001)
        time.sleep(0.5)  # and a while longer to get it wrong
        done = [layer for layer, f in enumerate(counter.futures[index]) if f.done()]
        assert done == [], f"layers {done} were completed while the gate held every copy"
        assert not any(dst_equal(kv, truth, p) for p in planes_of(0)), "the gate did not hold the copy"
    finally:
        with torch.cuda.stream(torch.cuda.Stream()):
            word.fill_(1)  # open the gate
    counter.set_consumer(index)
    for layer in range(LAYERS):
        counter.wait_until(layer)
    assert loader.finish(index) is True
    counter.check = None
    assert counter.violations == []
    torch.cuda.synchronize()
    assert dst_equal(kv, truth)
    loader.drain()
