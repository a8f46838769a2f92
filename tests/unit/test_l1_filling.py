"""An L1 object filling from the shared tier: visible once published, its landed word rising layer group by
group, whole once its fill ends complete; a failed fill fails every reader and gives its room back with the
last lock. A real pool (shared memory) and real threads, no server."""

import threading

import pytest

from kvstrata.core.store.l1_store import ALL_LAYERS, FillFailed, L1Store, layers_landed, split_generation_table

SHAPE = (2, 8, 2, 64)
TOKENS = 16
NBYTES = 2 * 8 * 2 * 64 * TOKENS
BOUND = 30.0
"""Seconds a wait may take before the test calls it a hang."""


@pytest.fixture
def store():
    s = L1Store(8 * NBYTES + (1 << 20), max_objects=64)
    yield s
    s.close()


def filling(store: L1Store, digest: bytes):
    obj = store.reserve(digest, TOKENS, NBYTES, SHAPE)
    store.publish_filling(obj)
    return obj


def test_a_committed_object_has_every_layer_and_a_reserved_one_none(store) -> None:
    obj = store.reserve(b"a" * 16, TOKENS, NBYTES, SHAPE)
    assert store.landed[obj.slot] == 0 and store.lookup("r", [b"a" * 16], lock=False) == []
    store.commit(obj)
    assert store.landed[obj.slot] == ALL_LAYERS
    assert layers_landed(store.landed, [obj.slot]) == int(ALL_LAYERS)


def test_a_published_object_is_found_before_its_bytes_and_its_layers_land_in_order(store) -> None:
    obj = filling(store, b"b" * 16)
    assert store.lookup("r", [b"b" * 16]) == [obj]  # found and locked while it fills
    assert layers_landed(store.landed, [obj.slot]) == 0
    store.set_landed(obj, 4)
    store.wait_landed([obj], 4, BOUND)  # returns at once
    waited = []
    reader = threading.Thread(target=lambda: waited.append(store.wait_landed([obj], 8, BOUND)))
    reader.start()
    reader.join(0.1)
    assert reader.is_alive(), "a reader of all eight layers waits while only four have landed"
    store.end_fill(obj, complete=True)
    reader.join(BOUND)
    assert waited == [None] and store.landed[obj.slot] == ALL_LAYERS and not obj.filling
    store.release_locks("r")
    assert obj.locks == 0  # the fill's own lock went with end_fill


def test_a_failed_fill_fails_its_readers_hides_the_object_and_frees_it_with_the_last_lock(store) -> None:
    obj = filling(store, b"c" * 16)
    assert store.lookup("r", [b"c" * 16]) == [obj]
    generation = int(store.generations[obj.slot])
    free_before = store.stats()["free_bytes"]
    failures = []

    def read() -> None:
        try:
            store.wait_landed([obj], 8, BOUND)
        except FillFailed as exc:
            failures.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    store.end_fill(obj, complete=False)
    reader.join(BOUND)
    assert len(failures) == 1
    assert store.generations[obj.slot] == 0 and generation != 0  # an engine's generation check fails too
    assert store.lookup("later", [b"c" * 16], lock=False) == []
    assert store.reserve(b"c" * 16, TOKENS, NBYTES, SHAPE) is None  # still locked by "r": not stored over yet
    assert store.stats()["free_bytes"] == free_before
    store.release_locks("r")
    assert store.stats()["free_bytes"] == free_before + NBYTES  # freed with its last lock
    again = store.reserve(b"c" * 16, TOKENS, NBYTES, SHAPE)  # the chunk can be stored anew
    assert again is not None and again is not obj


def test_an_engine_reads_both_tables_from_one_segment(store) -> None:
    """What an engine maps read-only: the generation words, then the landed words, ``2 * slots`` in all."""
    import numpy as np

    obj = filling(store, b"d" * 16)
    store.set_landed(obj, 2)
    words = np.frombuffer(store.generation_segment.buf, dtype=np.uint64, count=2 * store.max_objects)
    generations, landed = split_generation_table(words, store.max_objects)
    assert generations[obj.slot] == obj.generation and landed[obj.slot] == 2
    store.end_fill(obj, complete=True)
