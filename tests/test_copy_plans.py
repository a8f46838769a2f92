"""The CUDA executor's copy-engine plans, checked on the CPU: no device is touched to plan a piece.

A staged piece's host<->staging copy is planned once per transfer and shifted per
piece; for objects back to back in the pool it is one packed 2D job. Both fast
paths must give exactly the jobs the general planner (``plan_dma`` over every
(object, plane) range) gives.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from kvstrata.core.transfer import planner
from kvstrata.core.testing.reference_engine import ReferenceEngine
from kvstrata.native.cuda_executor import STRIPE_ALIGN, CudaExecutor, plan_dma, split_jobs

from helpers import SMALL_32

T = 64  # tokens per object


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
            assert ex._tables[("dma", 1, to_device)].__class__ is tuple  # the packed one-row path was taken
    finally:
        cache.close()


def moved_bytes(jobs) -> list[tuple[int, int]]:
    """Every (dst, src) byte pair a job list moves, one entry per byte, in no particular order."""
    out = []
    for d, dp, src, sp, w, h in jobs:
        for i in range(h):
            out.extend(zip(range(d + i * dp, d + i * dp + w), range(src + i * sp, src + i * sp + w)))
    return out


SPLIT_CASES = {
    "one 2D job": [(1 << 20, 8192, 1 << 30, 65536, 8192, 118)],
    "one 2D job, fewer rows than parts": [(0, 4096, 1 << 30, 8192, 4096, 2)],
    "one run": [(1 << 20, 40960, 1 << 30, 40960, 40960, 1)],
    "a run shorter than a page": [(0, 1000, 1 << 30, 1000, 1000, 1)],
    "mixed": [(0, 512, 1 << 30, 2048, 512, 7), (1 << 16, 12288, (1 << 30) + (1 << 20), 12288, 12288, 1),
              (1 << 18, 256, (1 << 31), 1024, 256, 3)],
}


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
def test_split_jobs_moves_every_byte_once_in_about_equal_groups(case: str, parts: int) -> None:
    jobs = SPLIT_CASES[case]
    groups = split_jobs(jobs, parts)
    assert 1 <= len(groups) <= parts and all(groups)
    assert sorted(moved_bytes([j for g in groups for j in g])) == sorted(moved_bytes(jobs))
    sizes = [sum(w * h for *_, w, h in g) for g in groups]
    total = sum(sizes)
    # the finest cut: a row of a 2D job, a page of a run
    unit = max([STRIPE_ALIGN] + [w for *_, w, h in jobs if h > 1])
    if case in ("one 2D job", "one run", "mixed"):
        # the groups are as even as those cuts allow, and every part is used
        assert len(groups) == parts, sizes
        assert max(sizes) - min(sizes) <= 2 * unit, sizes
    assert total == sum(w * h for *_, w, h in jobs)


def test_split_jobs_cuts_a_2d_job_between_rows_and_a_run_at_pages() -> None:
    (a,), (b,) = split_jobs([(100, 8192, 1000, 65536, 4096, 10)], 2)
    assert a == (100, 8192, 1000, 65536, 4096, 5) and b == (100 + 5 * 8192, 8192, 1000 + 5 * 65536, 65536, 4096, 5)
    (c,), (d,) = split_jobs([(0, 10 * STRIPE_ALIGN + 5, 1 << 30, 10 * STRIPE_ALIGN + 5, 10 * STRIPE_ALIGN + 5, 1)], 2)
    assert c[4] % STRIPE_ALIGN == 0 and c[4] + d[4] == 10 * STRIPE_ALIGN + 5 and d[0] == c[4]


def test_split_jobs_refuses_no_parts() -> None:
    with pytest.raises(ValueError, match="parts"):
        split_jobs([(0, 1, 0, 1, 1, 1)], 0)
