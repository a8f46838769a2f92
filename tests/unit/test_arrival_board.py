"""The arrival board across real processes: many updates, generations on slot reuse, failure state."""

import multiprocessing as mp

import pytest

from kvstrata.core.arrival.board import ArrivalBoard, NO_PROGRESS, SLOT_BYTES
from kvstrata.core.arrival.pool import ArrivalPool
from kvstrata.core.shm import CONTROL_HEADER_BYTES, Segment, SegmentKindError, new_segment_name

from helpers import control_segment_of_unknown_kind
from kvstrata.core.arrival.events import HostEventBackend


def _writer(name: str, plan: list[tuple[int, int, int, bool]]) -> None:
    board = ArrivalBoard.attach(name)
    for slot, generation, layers, fail in plan:
        if fail:
            board.fail(slot, generation, layers)
        else:
            board.publish(slot, generation, layers, complete=False)
    board.close()


def _monotonic_writer(name: str, slot: int, generation: int, layers: int, rounds: int) -> None:
    """Publishes 1..layers, each ``rounds`` times over: many writes, never a smaller count than before."""
    board = ArrivalBoard.attach(name)
    for n in range(1, layers + 1):
        for _ in range(rounds):
            board.publish(slot, generation, n, complete=n == layers)
    board.close()


def test_slots_sit_on_their_own_cache_lines():
    board = ArrivalBoard.create(4)
    try:
        assert SLOT_BYTES == 64 and board.segment.size == CONTROL_HEADER_BYTES + 4 * 64
        assert [board.word_offset(s) % 64 for s in range(4)] == [0] * 4
    finally:
        board.destroy()


def test_a_reader_sees_monotonic_progress_from_another_process():
    ctx = mp.get_context("spawn")
    board = ArrivalBoard.create(8)
    try:
        procs = [ctx.Process(target=_monotonic_writer, args=(board.name, s, 7, 32, 200)) for s in range(4)]
        for p in procs:
            p.start()
        last = [0] * 4
        reads = 0
        while any(p.is_alive() for p in procs):
            for s in range(4):
                prog = board.read(s, 7)
                assert 0 <= prog.layers <= 32
                assert prog.layers >= last[s], f"slot {s} went back from {last[s]} to {prog.layers} layers"
                last[s] = prog.layers
                reads += 1
            # other generations never leak in
            assert board.read(0, 6) == NO_PROGRESS
        for p in procs:
            p.join()
            assert p.exitcode == 0
        for s in range(4):
            final = board.read(s, 7)
            assert final.layers == 32 and final.complete and not final.failed
        assert reads > 0
        assert all(board.read(s, 7) == NO_PROGRESS for s in range(4, 8))
    finally:
        board.destroy()


def test_slot_reuse_with_generations_and_failure_cross_process():
    ctx = mp.get_context("spawn")
    pool = ArrivalPool(1, 32, HostEventBackend())
    try:
        first = pool.acquire()
        assert first.generation == 1
        p = ctx.Process(target=_writer, args=(pool.board.name, [(first.index, first.generation, 32, False)]))
        p.start(); p.join()
        assert first.progress().layers == 32
        assert pool.acquire() is None  # exhausted
        pool.release(first)
        second = pool.acquire()
        assert second is first and second.generation == 2
        # the previous retrieve's 32 layers must not count for this one
        assert second.progress() == NO_PROGRESS
        p = ctx.Process(target=_writer, args=(pool.board.name, [(second.index, 2, 3, False), (second.index, 2, 3, True)]))
        p.start(); p.join()
        prog = second.progress()
        assert prog.failed and prog.layers == 3
    finally:
        pool.close()


def test_board_attach_rejects_bad_segments_and_slots():
    board = ArrivalBoard.create(2)
    retired = control_segment_of_unknown_kind()
    plain = Segment(new_segment_name("pool"), 4096, create=True)  # e.g. an L1 pool: any size, no header
    try:
        with pytest.raises(IndexError, match="has 2 slots, slot 5 asked"):
            board.publish(5, 1, 1)
        with pytest.raises(SegmentKindError, match="no shared-memory segment"):
            ArrivalBoard.attach("kvstrata-board-does-not-exist")
        with pytest.raises(SegmentKindError, match="carries no kvstrata control header"):
            ArrivalBoard.attach(plain.name)
        with pytest.raises(SegmentKindError, match="carries no kvstrata control header"):
            ArrivalBoard.attach(retired.name)
        attached = ArrivalBoard.attach(board.name)
        try:
            assert attached.num_slots == 2
            with pytest.raises(ValueError, match="slot 2 is not one"):
                attached.check_ref(2, 1)
            with pytest.raises(ValueError, match="generation 0 is not in"):
                attached.check_ref(0, 0)
            with pytest.raises(ValueError, match="generation 4294967296 is not in"):
                attached.check_ref(1, 1 << 32)
            attached.check_ref(1, 7)
        finally:
            attached.close()
        assert bytes(plain.buf[:64]) == bytes(64)  # nothing was written into what was refused
    finally:
        board.destroy()
        retired.destroy()
        plain.destroy()
