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
from kvstrata.adapters.reference.engine import ReferenceEngine
from kvstrata.native.cuda_executor import CudaExecutor, plan_dma

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
