"""The L1 pool registered for DMA in the background (engine placement's start): copies read it before, while and
after it is registered, byte-exact, and closing lets go of the registration."""

from __future__ import annotations

import pytest

from kvstrata.core.store.l1_store import L1Store
from kvstrata.core.transfer import planner

from gpu_helpers import shuffled_blocks
from test_gpu_kernels import SKIP, TOKENS, make_cache, retrieve_job, store_objects


def engine_ext():
    from kvstrata.native import cuda_ext

    return cuda_ext.load()


@pytest.fixture
def pool():
    store = L1Store(64 << 20)
    yield store
    store.close()


def background_engine(cache, store: L1Store):
    from kvstrata.native.cuda_executor import CudaTransferConfig, CudaTransferEngine

    return CudaTransferEngine(cache.layout, cache.region_tensors(), store.pool, 0,
                              CudaTransferConfig(mode="staged"), pin_in_background=True)


def load_and_check(engine, cache, objects, truth, width: int, seed: int) -> None:
    nb = -(-TOKENS // 16)
    dst = shuffled_blocks(seed * nb, nb, seed=seed)
    cache.poison(dst)
    planner.run_transfer(engine.executor(objects), retrieve_job(cache, objects, dst), width)
    engine.synchronize()
    assert cache.read(dst, SKIP, TOKENS).equal(truth[:, :, SKIP:]), f"width {width}"


def test_copies_read_the_pool_unregistered_then_registered(pool) -> None:
    from kvstrata.native.host_pinning import PoolPinning

    nb = -(-TOKENS // 16)
    cache = make_cache("vllm-LBNHC", "bfloat16", num_blocks=4 * nb + 4)
    truth = cache.random_kv(TOKENS, seed=21)
    objects = store_objects(pool, cache, truth)
    engine = background_engine(cache, pool)
    try:
        pinning = engine.pinning
        assert pinning.background
        pinning.close()  # waits for the registration and lets go of it: the pool is not registered now
        assert not pinning.registered
        load_and_check(engine, cache, objects, truth, width=1, seed=1)  # the copy engine reads pageable memory
        engine.pinning = PoolPinning(pool.pool, 0, engine.ext, background=True)
        load_and_check(engine, cache, objects, truth, width=3, seed=2)  # while it registers, or after
        assert engine.pinning.wait(120) and engine.pinning.error is None and engine.pinning.registered
        load_and_check(engine, cache, objects, truth, width=0, seed=3)
    finally:
        engine.close()
    # let go: a part of the pool registers apart now (while the whole was registered, that was refused)
    from kvstrata.native.host_pinning import pin_host_range, unpin_host_range

    part = pool.pool.data_ptr() + (4 << 20)
    pin_host_range(part, 4 << 20, 0, engine_ext())
    unpin_host_range(part, 4 << 20, engine_ext())


def test_kernel_mode_registers_at_once(pool) -> None:
    """Kernels reading the pool in place need it registered before the first copy: no background there."""
    from kvstrata.native.cuda_executor import CudaTransferConfig, CudaTransferEngine

    cache = make_cache("vllm-LBNHC", "bfloat16", num_blocks=16)
    engine = CudaTransferEngine(cache.layout, cache.region_tensors(), pool.pool, 0, CudaTransferConfig(mode="kernel"),
                                pin_in_background=True)
    try:
        assert not engine.pinning.background and engine.pinning.done()
        assert engine.pinning.registered
    finally:
        engine.close()


def test_a_range_overlapping_a_registered_one_is_refused(pool) -> None:
    from kvstrata.native.host_pinning import PoolPinning, pin_host_range

    at_once = PoolPinning(pool.pool, 0, engine_ext())
    try:
        with pytest.raises(ValueError, match="overlaps a range registered apart"):
            pin_host_range(pool.pool.data_ptr() + (4 << 20), 4 << 20, 0, engine_ext())
    finally:
        at_once.close()
