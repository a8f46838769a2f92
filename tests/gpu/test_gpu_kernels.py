"""The CUDA executors in-process, against the engines' own views and the pure-torch oracle.

No server here: the L1 pool is a real L1Store (shared memory, pinned once), the
caches are allocated the way each engine allocates them, and every width's
result is compared byte for byte with what was stored and with the torch
reference running the same plan.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvstrata.core.transfer import planner
from kvstrata.core.store.l1_store import L1Store

from gpu_helpers import FORMAT_CASES, WIDTHS, shuffled_blocks

CHUNK = 64
TOKENS = 150  # two full chunks and a partial one
SKIP = 10  # the first copy starts inside its chunk


def make_cache(fmt: str, dtype: str, num_blocks: int):
    from kvstrata_testing.gpu_caches import GpuKVCache

    return GpuKVCache(fmt, num_layers=32, num_heads=2, head_size=64, dtype=dtype, num_blocks=num_blocks,
                      block_size=16)


def make_engine(cache, store: L1Store, mode: str, **config):
    from kvstrata.native.cuda_executor import CudaTransferConfig, CudaTransferEngine

    engine = CudaTransferEngine(cache.layout, cache.region_tensors(), store.pool, 0,
                                CudaTransferConfig(mode=mode, **config))
    _engines.append(engine)
    return engine


def store_objects(store: L1Store, cache, truth: torch.Tensor) -> list[torch.Tensor]:
    """L1 objects holding ``truth`` (canonical bytes) in chunks, as a STORE leaves them."""
    host = truth.cpu()
    objects = []
    for i, start in enumerate(range(0, host.shape[2], CHUNK)):
        n = min(CHUNK, host.shape[2] - start)
        obj = store.reserve(os.urandom(16), n, cache.layout.object_bytes(n), cache.layout.shape_signature())
        view = store.object_view(obj)
        view.copy_(host[:, :, start:start + n])
        store.commit(obj)
        objects.append(view)
    return objects


def retrieve_job(cache, objects, blocks, skip=SKIP):
    copies = planner.plan_copies([o.shape[2] for o in objects], CHUNK, 0, skip)
    return planner.TransferJob(cache.layout, [blocks], copies)


_engines: list = []


@pytest.fixture(scope="module")
def l1():
    store = L1Store(64 << 20)
    yield store
    for engine in _engines:  # unpin before the pool's memory is unmapped
        engine.close()
    _engines.clear()
    store.close()


@pytest.mark.parametrize("mode", ["kernel", "staged", "torch"])
@pytest.mark.parametrize("fmt,dtype", FORMAT_CASES)
def test_every_width_scatters_the_stored_bytes(l1, fmt, dtype, mode):
    nb = -(-TOKENS // 16)
    cache = make_cache(fmt, dtype, num_blocks=(len(WIDTHS) + 1) * nb + 4)
    engine = make_engine(cache, l1, mode)
    truth = cache.random_kv(TOKENS, seed=hash((fmt, dtype)) & 0xFFFF)
    objects = store_objects(l1, cache, truth)
    results = {}
    for i, width in enumerate([0] + WIDTHS):
        dst = shuffled_blocks(i * nb, nb, seed=i)
        cache.poison(dst)
        job = retrieve_job(cache, objects, dst)
        planner.run_transfer(engine.executor(objects), job, width)
        engine.synchronize()
        got = cache.read(dst, SKIP, TOKENS)
        results[width] = got
        assert got.equal(truth[:, :, SKIP:]), f"{fmt}/{dtype} {mode}: width {width} differs from the stored bytes"
        # tokens before the skip were not asked for and must be left alone
        assert (cache.read(dst, 0, SKIP) == 0xA5).all(), f"width {width} wrote skipped tokens"
    for width in WIDTHS:
        for layer in range(cache.num_layers):
            assert results[width][:, layer].equal(results[0][:, layer]), (width, layer)


@pytest.mark.parametrize("mode", ["kernel", "staged", "torch"])
@pytest.mark.parametrize("fmt,dtype", FORMAT_CASES)
def test_gather_reads_the_engine_blocks(l1, fmt, dtype, mode):
    nb = -(-TOKENS // 16)
    cache = make_cache(fmt, dtype, num_blocks=nb + 3)
    engine = make_engine(cache, l1, mode)
    truth = cache.random_kv(TOKENS, seed=7)
    blocks = shuffled_blocks(2, nb, seed=3)
    cache.write(truth, blocks)
    torch.cuda.synchronize()
    for start in range(0, TOKENS, CHUNK):
        n = min(CHUNK, TOKENS - start)
        obj = l1.reserve(os.urandom(16), n, cache.layout.object_bytes(n), cache.layout.shape_signature())
        view = l1.object_view(obj)
        view.fill_(0x5A)
        job = planner.TransferJob(cache.layout, [blocks], [planner.ChunkCopy(0, 0, n, start)])
        engine.executor([view]).gather(job)
        engine.synchronize()
        assert view.equal(truth[:, :, start:start + n].cpu()), f"{fmt}/{dtype} {mode}: chunk at {start}"
        l1.abandon(obj)


@pytest.mark.parametrize("fmt,dtype", [("sglang", "bfloat16"), ("vllm-mla", "bfloat16")])
def test_copy_engine_writes_dense_layouts_directly(l1, fmt, dtype):
    """Staged mode with consecutive blocks: the copy engine writes the cache, no staging, no kernel."""
    nb = -(-TOKENS // 16)
    cache = make_cache(fmt, dtype, num_blocks=2 * nb + 2)
    engine = make_engine(cache, l1, "staged", direct_copy_min_run=0)
    truth = cache.random_kv(TOKENS, seed=11)
    objects = store_objects(l1, cache, truth)
    for width in [0, 1, 3]:
        dst = list(range(nb + 1, 2 * nb + 1))
        cache.poison(dst)
        job = retrieve_job(cache, objects, dst, skip=0)
        ex = engine.executor(objects)
        assert ex._direct_runs(job, 0, 1) is not None, "expected the direct copy-engine path"
        planner.run_transfer(ex, job, width)
        engine.synchronize()
        assert cache.read(dst, 0, TOKENS).equal(truth), f"width {width}"
    assert not engine._staging, "direct copies must not allocate a staging buffer"


def test_layer_selector_defaults_reproduce_all_layer_addressing(l1):
    """staged_layers = all and layer_offset = 0 is the chunk-major launch, byte for byte."""
    cache = make_cache("vllm-LBNHC", "bfloat16", num_blocks=24)
    engine = make_engine(cache, l1, "kernel")
    truth = cache.random_kv(TOKENS, seed=5)
    objects = store_objects(l1, cache, truth)
    a, b = shuffled_blocks(0, 10, 1), shuffled_blocks(12, 10, 2)
    cache.poison(a + b)
    ex = engine.executor(objects)
    ex.scatter(retrieve_job(cache, objects, a), 0, 0)  # chunk-major: the default selector
    job_b = retrieve_job(cache, objects, b)
    ex2 = engine.executor(objects)
    ex2.scatter(job_b, 0, cache.num_layers)  # one explicit slice of every layer
    engine.synchronize()
    assert cache.read(a, SKIP, TOKENS).equal(cache.read(b, SKIP, TOKENS))


def test_staging_is_sized_to_the_slice_not_to_all_layers(l1):
    cache = make_cache("vllm-LBNHC", "bfloat16", num_blocks=12)
    engine = make_engine(cache, l1, "staged")
    truth = cache.random_kv(TOKENS, seed=9)
    objects = store_objects(l1, cache, truth)
    dst = shuffled_blocks(0, 10, 4)
    planner.run_transfer(engine.executor(objects), retrieve_job(cache, objects, dst), 1)
    engine.synchronize()
    one_layer = cache.kv_size * (TOKENS - SKIP) * cache.layout.token_bytes_per_layer
    assert engine._staging and max(t.numel() for t in engine._staging) == one_layer
    assert cache.read(dst, SKIP, TOKENS).equal(truth[:, :, SKIP:])


def test_a_token_table_is_never_memory_the_planning_threads_stream_just_freed(l1):
    """A load planned on the engine's thread leases a token-table slot; one made then must come from the copier's
    own kernel stream. Allocated on the engine's stream, it could be a block the engine had just freed with kernels
    still queued to write it, which would overwrite the table under the scatter kernel (seen: cudaErrorIllegalAddress
    when chunk-major loads were planned between the engine's steps)."""
    cache = make_cache("vllm-LBNHC", "bfloat16", num_blocks=12)
    engine = make_engine(cache, l1, "staged")
    truth = cache.random_kv(TOKENS, seed=11)
    objects = store_objects(l1, cache, truth)
    dst = shuffled_blocks(0, 10, 6)
    freed = torch.empty(3 << 15, dtype=torch.int64, device="cuda")  # a slot's size, on the engine's stream
    freed_at = freed.data_ptr()
    del freed  # back in the engine stream's pool: the next allocation of this size there gets it
    assert not engine._table_slots
    planner.run_transfer(engine.executor(objects), retrieve_job(cache, objects, dst), 1)
    engine.synchronize()
    assert engine._table_slots and all(slot.dev.data_ptr() != freed_at for slot in engine._table_slots)
    again = torch.empty(3 << 15, dtype=torch.int64, device="cuda")
    assert again.data_ptr() == freed_at  # the block was there to take: the check above was not vacuous
    assert cache.read(dst, SKIP, TOKENS).equal(truth[:, :, SKIP:])


@pytest.mark.parametrize("buffers", [2, 3, 4])
def test_any_number_of_staging_buffers_moves_the_same_bytes(l1, buffers):
    """The copies take turns on ``staging_buffers`` buffers. One-layer buffers split every slice into pieces of a
    layer, so each buffer is filled and reused many times in one transfer, loading and storing."""
    nb = -(-TOKENS // 16)
    cache = make_cache("vllm-LBNHC", "bfloat16", num_blocks=3 * nb + 4)
    one_layer = cache.kv_size * TOKENS * cache.layout.token_bytes_per_layer
    engine = make_engine(cache, l1, "staged", staging_bytes=one_layer, staging_buffers=buffers)
    truth = cache.random_kv(TOKENS, seed=11)
    objects = store_objects(l1, cache, truth)
    for i, width in enumerate([0, 8]):
        dst = shuffled_blocks(i * nb, nb, seed=20 + i)
        cache.poison(dst)
        planner.run_transfer(engine.executor(objects), retrieve_job(cache, objects, dst), width)
        engine.synchronize()
        assert cache.read(dst, SKIP, TOKENS).equal(truth[:, :, SKIP:]), f"{buffers} buffers, width {width}"
    assert len(engine._staging) == buffers
    src = shuffled_blocks(2 * nb, nb, seed=30)
    cache.write(truth, src)
    torch.cuda.synchronize()
    obj = l1.reserve(os.urandom(16), TOKENS, cache.layout.object_bytes(TOKENS), cache.layout.shape_signature())
    view = l1.object_view(obj)
    view.fill_(0x5A)
    engine.executor([view]).gather(planner.TransferJob(cache.layout, [src], [planner.ChunkCopy(0, 0, TOKENS, 0)]))
    engine.synchronize()
    assert view.equal(truth.cpu()), f"{buffers} buffers: the store differs"
    l1.abandon(obj)


def test_unpinned_objects_are_refused_with_a_clear_error(l1):
    from kvstrata.native.cuda_executor import CudaTransferConfig, CudaTransferEngine

    cache = make_cache("vllm-LBNHC", "bfloat16", num_blocks=12)
    engine = CudaTransferEngine(cache.layout, cache.region_tensors(), None, 0, CudaTransferConfig(mode="kernel"))
    stray = torch.zeros(cache.layout.object_shape(16), dtype=torch.uint8)
    with pytest.raises(ValueError, match="not pinned"):
        engine.executor([stray])


@pytest.mark.parametrize("mode", ["kernel", "staged"])
@pytest.mark.parametrize("fmt,dtype", [("vllm-LBNHC", "bfloat16"), ("trtllm", "float8_e4m3fn"), ("sglang-mla", "bfloat16")])
def test_whole_chunks_every_width(l1, fmt, dtype, mode):
    """Whole objects only (no skip, no partial chunk): staged mode plans one piece and shifts it per slice."""
    tokens = 3 * CHUNK
    nb = tokens // 16
    cache = make_cache(fmt, dtype, num_blocks=7 * nb)
    engine = make_engine(cache, l1, mode)
    truth = cache.random_kv(tokens, seed=21)
    objects = store_objects(l1, cache, truth)
    for i, width in enumerate([0, 1, 2, 3, 8, 32]):
        dst = shuffled_blocks(i * nb, nb, seed=40 + i)
        cache.poison(dst)
        planner.run_transfer(engine.executor(objects), retrieve_job(cache, objects, dst, skip=0), width)
        engine.synchronize()
        assert cache.read(dst, 0, tokens).equal(truth), f"{fmt} {mode} width {width}"


@pytest.mark.parametrize("mode", ["kernel", "staged"])
def test_hybrid_layout_matches_the_torch_oracle(l1, mode):
    """Two KV groups with their own block tables (hybrid model): the native path walks each group's
    layer runs; the pure-torch reference running the same plan is the oracle."""
    import dataclasses

    cache = make_cache("vllm-LBNHC", "bfloat16", num_blocks=48)
    layout = dataclasses.replace(cache.layout, layer_groups=(tuple(range(0, 32, 2)), tuple(range(1, 32, 2))))
    native = make_engine(cache, l1, mode)
    native.layout = layout
    oracle = make_engine(cache, l1, "torch")
    oracle.layout = layout
    truth = cache.random_kv(TOKENS, seed=33)
    objects = store_objects(l1, cache, truth)
    nb = -(-TOKENS // 16)
    groups_a = [shuffled_blocks(0, nb, 1), shuffled_blocks(nb, nb, 2)]
    groups_b = [shuffled_blocks(2 * nb, nb, 3), shuffled_blocks(3 * nb, nb, 4)]
    for width in (0, 1, 3):
        cache.poison(groups_a[0] + groups_a[1] + groups_b[0] + groups_b[1])
        copies = planner.plan_copies([o.shape[2] for o in objects], CHUNK, 0, SKIP)
        planner.run_transfer(native.executor(objects), planner.TransferJob(layout, groups_a, copies), width)
        planner.run_transfer(oracle.executor(objects), planner.TransferJob(layout, groups_b, copies), width)
        native.synchronize()
        oracle.synchronize()
        for layer in range(32):
            g = layer % 2
            got = cache.read(groups_a[g], SKIP, TOKENS, [layer])
            assert got.equal(cache.read(groups_b[g], SKIP, TOKENS, [layer])), (width, layer)
            assert got.equal(truth[:, layer:layer + 1, SKIP:]), (width, layer)


def test_spin_until_readable_keeps_a_stream_warm_and_still_sees_the_socket() -> None:
    """The server's busy poll with warm_stream: readable fd -> True at once; quiet fd -> False after max_us,
    having queried the stream meanwhile without disturbing work queued on it."""
    import time

    from kvstrata.native import cuda_ext

    ext = cuda_ext.load()
    stream = torch.cuda.Stream()
    r, w = os.pipe()
    try:
        big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(stream):
            big.fill_(7)  # work in flight on the stream being queried
        t = time.perf_counter()
        assert ext.spin_until_readable(r, 20_000, warm_stream=stream.cuda_stream) is False
        assert time.perf_counter() - t >= 0.019
        os.write(w, b"x")
        t = time.perf_counter()
        assert ext.spin_until_readable(r, 2_000_000, warm_stream=stream.cuda_stream) is True
        assert time.perf_counter() - t < 0.5
        stream.synchronize()
        assert int(big[-1]) == 7
        assert ext.spin_until_readable(r, 1000) is True  # without a stream, as the client uses it
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("direction", ["to_device", "to_host"])
def test_several_rows_copy_every_range_where_its_row_says_and_nothing_else(direction) -> None:
    """memcpy2d_runs with several rows: rows of one range and rows of equally spaced ranges, from pinned host memory
    to the device and back; every range lands where its row says and the bytes between them stay as they were."""
    import numpy as np

    from kvstrata.native import cuda_ext

    ext = cuda_ext.load()
    n = 1 << 20
    host = torch.randint(0, 256, (n,), dtype=torch.uint8).pin_memory()
    dev = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    src, dst = (host, dev) if direction == "to_device" else (dev, host)
    before = dst.clone()
    # (dst offset, dst pitch, src offset, src pitch, width, height): odd widths and offsets, pitches apart
    shapes = [(0, 0, 4096, 0, 1000, 1), (8192, 3000, 100, 70_000, 777, 3), (200_000, 65_536, 300_000, 4096, 4096, 5),
              (900_000, 0, 17, 0, 1, 1)]
    rows = np.asarray([(dst.data_ptr() + d, dp, src.data_ptr() + s, sp, w, h) for d, dp, s, sp, w, h in shapes],
                      dtype=np.int64)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    ext.memcpy2d_runs(rows.ctypes.data, len(rows), 0, stream.cuda_stream)
    stream.synchronize()
    want = before.cpu()
    s_host = src.cpu()
    for d, dp, s, sp, w, h in shapes:
        for i in range(h):
            want[d + i * dp:d + i * dp + w] = s_host[s + i * sp:s + i * sp + w]
    assert dst.cpu().equal(want)
