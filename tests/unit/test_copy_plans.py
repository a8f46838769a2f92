"""The CUDA executor's copy-engine plans, checked on the CPU: no device is touched to plan a piece.

A staged piece's host<->staging copy is planned once per transfer and shifted per
piece; for objects back to back in the pool it is one packed 2D job. Both must
give exactly the jobs the general planner (``plan_dma`` over every (object, plane)
range) gives, also where copies are parts of objects or objects differ in size.
(That a load's slices written into one program at once are the ops of planning them slice by slice is checked
with the writer's C++: ``test_staged_slices_writer.py`` here, ``tests/gpu/test_gpu_staged_slices.py`` through the
extension.)
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from kvstrata.core.transfer import planner
from kvstrata.adapters.reference.engine import ReferenceEngine
from kvstrata.native.cuda_executor import CudaExecutor, plan_dma
from kvstrata.native.load_issuer import LoadIssuer

from helpers import SMALL_32, T, RecordingNative, uneven_job

def stand_in_engine(layout):
    row = np.zeros(6, dtype=np.int64)
    return types.SimpleNamespace(layout=layout, row_bytes=layout.token_bytes_per_layer, _job_row=row,
                                 _job_row_addr=row.ctypes.data)


def byte_ranges(jobs: np.ndarray) -> list[tuple[int, int, int]]:
    """(dst, src, bytes) ranges a job list moves, adjacent ones merged: equal lists move the same bytes."""
    out: list[list[int]] = []
    for d, dp, src, sp, w, h in jobs.tolist():
        for i in range(h):
            dd, ss = d + i * dp, src + i * sp
            if out and out[-1][0] + out[-1][2] == dd and out[-1][1] + out[-1][2] == ss:
                out[-1][2] += w
            else:
                out.append([dd, ss, w])
    return [tuple(r) for r in out]


def read_rows(engine, addr: int, n: int, keep) -> np.ndarray:
    if addr == engine._job_row_addr:
        return engine._job_row.reshape(1, 6).copy()
    assert keep is not None and keep.ctypes.data == addr
    return np.asarray(keep).reshape(n, 6).copy()


@pytest.mark.parametrize("gap", [0, 4096], ids=["back-to-back", "gapped"])
@pytest.mark.parametrize("to_device", [True, False], ids=["retrieve", "store"])
def test_piece_jobs_equal_the_general_plan(gap: int, to_device: bool) -> None:
    cache = ReferenceEngine(SMALL_32, num_blocks=64, block_size=16)
    try:
        layout = cache.layout
        engine = stand_in_engine(layout)
        obj_bytes = layout.object_bytes(T)
        n_obj = 4
        hosts = [(1 << 40) + i * (obj_bytes + gap) for i in range(n_obj)]
        ex = CudaExecutor(engine, None, addresses=([h + (1 << 44) for h in hosts], hosts, [T] * n_obj))
        copies = planner.plan_copies([T] * n_obj, T, 0, 0)
        job = planner.TransferJob(layout, [list(range(n_obj * T // 16))], copies)
        stage = 1 << 36
        for count in (1, 3, 32):
            for first in range(0, layout.num_layers - count + 1, max(count, 5)):
                got = read_rows(engine, *ex._piece_jobs(job, first, count, stage, to_device))
                want = plan_dma(ex._object_runs(job, first, count, stage, to_device))
                assert byte_ranges(got) == byte_ranges(want), (count, first)
                assert len(got) <= len(want)
        if gap == 0:
            assert ex._tables[("dma", 1, to_device)][0].__class__ is tuple  # the packed one-row path was taken
    finally:
        cache.close()


@pytest.mark.parametrize("to_device", [True, False], ids=["retrieve", "store"])
@pytest.mark.parametrize("skip", [0, 20], ids=["whole-first", "part-of-first"])
def test_piece_jobs_of_uneven_copies_equal_the_general_plan(to_device: bool, skip: int) -> None:
    cache = ReferenceEngine(SMALL_32, num_blocks=64, block_size=16)
    try:
        layout = cache.layout
        engine = stand_in_engine(layout)
        tokens, job = uneven_job(layout, 4, skip)
        hosts, h = [], 1 << 40
        for n in tokens:
            hosts.append(h)
            h += layout.object_bytes(n)
        ex = CudaExecutor(engine, None, addresses=([x + (1 << 44) for x in hosts], hosts, tokens))
        stage = 1 << 36
        for count in (1, 3, 32):
            for first in range(0, layout.num_layers - count + 1, max(count, 5)):
                got = read_rows(engine, *ex._piece_jobs(job, first, count, stage, to_device))
                want = plan_dma(ex._object_runs(job, first, count, stage, to_device))
                assert byte_ranges(sorted_jobs(got)) == byte_ranges(sorted_jobs(want)), (count, first)
    finally:
        cache.close()


def sorted_jobs(jobs: np.ndarray) -> np.ndarray:
    """Jobs in address order (the template folds each object size on its own, so its order may differ)."""
    return jobs[np.lexsort((jobs[:, 2], jobs[:, 0]))]


def submitted_marks(programs: list[np.ndarray]) -> list[int]:
    """The numbers of the MARK ops in submitted programs, in order (each op's words: code, argument count, args)."""
    from kvstrata.native.load_issuer import OP_MARK

    marks = []
    for program in programs:
        i = 0
        while i < len(program):
            if program[i] == OP_MARK:
                marks.append(int(program[i + 2]))
            i += 2 + int(program[i + 1])
    return marks


def test_marks_are_numbered_in_the_order_they_were_written_across_parts_and_programs() -> None:
    """Each MARK op's number word is the number its cell says, counting on across programs, wherever in a part
    the mark stands and whatever the other words hold (a row's word may equal the MARK op code)."""
    from kvstrata.native.load_issuer import OP_MARK, OP_MEMCPY2D, OP_RECORD_EVENT

    issuer = LoadIssuer(types.SimpleNamespace(LoadIssuer=RecordingNative), 0)
    cells = []
    for _ in range(2):
        with issuer.program():
            issuer.event_record(5, 11)
            cells.append(issuer.mark())
            row = [OP_MARK, 1, OP_MARK, 1, OP_MARK, 1]  # a copy job whose words look like marks
            words = [OP_MEMCPY2D, 8, 12, 1, *row, OP_MARK, 1, 0, OP_RECORD_EVENT, 2, 6, 11, OP_MARK, 1, 0]
            cells += issuer.record_ops(np.asarray(words, dtype=np.int64), [10, 17])
            cells.append(issuer.mark())
    assert [c[0] for c in cells] == list(range(1, 9))
    assert submitted_marks(issuer._native.programs) == list(range(1, 9))


class LaggingNative(RecordingNative):
    """Stands in for the native issuer thread, which issues submitted programs later than they are submitted: here
    only when a wait asks for a mark (everything up to it is then issued), so a flush that does not wait leaves
    programs unissued."""

    def __init__(self, device: int) -> None:
        super().__init__(device)
        self.issued = 0
        self.waited_for: list[int] = []

    def issued_mark(self) -> int:
        return self.issued

    def wait_mark(self, mark: int, timeout_us: int) -> bool:
        self.waited_for.append(mark)
        self.issued = max(self.issued, mark)
        return True

    def mark_error(self, mark: int) -> str:
        return ""


def test_a_flush_waits_for_every_program_handed_over_before_it_even_with_nothing_recorded_since() -> None:
    """A staging buffer is replaced (and the old one freed) right after a flush: every op already handed to the
    native thread, this thread's earlier hand-overs included, must be issued by then, also where the thread has
    recorded nothing since its last hand-over, and outside a program."""
    issuer = LoadIssuer(types.SimpleNamespace(LoadIssuer=LaggingNative), 0)
    native = issuer._native
    with issuer.program():
        issuer.event_record(5, 11)
        issuer.mark()
        issuer.hand_over()  # a copy on its way to the GPU, its program not issued yet
        issuer.flush()  # nothing recorded since the hand-over
        assert native.waited_for and native.issued >= max(submitted_marks(native.programs))
    with issuer.program():
        issuer.event_record(6, 11)
        issuer.mark()
    issuer.flush()  # outside a program: everything submitted so far
    assert native.issued >= max(submitted_marks(native.programs)) == 4
