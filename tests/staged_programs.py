"""Test support for the staged-slice writer (``native/csrc/staged_slices.h``): a staged executor's engine state with
every address a plain number and its programs recorded, and the checks both builds of the writer must pass (the
CUDA extension's, ``tests/gpu/test_gpu_staged_slices.py``; the same C++ built for the host,
``tests/unit/test_staged_slices_writer.py``)."""

from __future__ import annotations

import functools
import threading
import types
from typing import Callable

import numpy as np
import pytest

from kvstrata.adapters.reference.engine import ReferenceEngine
from kvstrata.core.transfer import planner

from helpers import SMALL_32, T, RecordingNative, uneven_job


class Buffer:
    def __init__(self, address: int) -> None:
        self.address = address

    def data_ptr(self) -> int:
        return self.address


def staged_engine(layout, staging_bytes: int, write_staged_slices: Callable[..., tuple[int, int]]):
    """The engine state a staged executor reads and writes, with every address a plain number; programs are
    recorded, and a load's later slices written by ``write_staged_slices`` (the extension's, or the same C++ built
    for the host)."""
    from kvstrata.native.cuda_executor import CudaTransferConfig, CudaTransferEngine
    from kvstrata.native.load_issuer import LoadIssuer

    row = np.zeros(6, dtype=np.int64)
    issuer = LoadIssuer(types.SimpleNamespace(LoadIssuer=RecordingNative,
                                              write_staged_slices=write_staged_slices), 0)
    tables = {}

    def build_table(desc, blocks, n_tok):  # a table per distinct request, at an address of its own
        key = (tuple(desc), tuple(blocks), n_tok)
        return tables.setdefault(key, (1 << 50) + (len(tables) << 20)), object()

    engine = types.SimpleNamespace(
        layout=layout, row_bytes=layout.token_bytes_per_layer, _job_row=row, _job_row_addr=row.ctypes.data,
        config=CudaTransferConfig(staging_bytes=staging_bytes), ext=issuer, copy_planned=issuer.hand_over, index=0,
        max_ctas=264,
        stream=types.SimpleNamespace(cuda_stream=11), copy_stream=types.SimpleNamespace(cuda_stream=12),
        planes=Buffer(1 << 48), layout_vec=16, dense_rows=False, _stage_lock=threading.Lock(), _piece=0,
        _used=[False, False], _idle_h=[21, 22], _filled_h=[31, 32], build_table=build_table,
        staging=lambda b, n: Buffer((1 << 46) + (b << 40)))
    engine.copy_into_staging = functools.partial(CudaTransferEngine.copy_into_staging, engine)  # the engine's own
    return engine


def assert_slices_in_one_program_are_planned_one_by_one(write_staged_slices: Callable[..., tuple[int, int]],
                                                        width: int, objects: str, staging: str) -> None:
    """A load's later slices written into one program (``CudaExecutor.scatter_slices``) are exactly the ops of
    planning them slice by slice with ``scatter``; the staging buffers' turn and use carry on alike.
    ``objects``: "back-to-back" or "uneven"; ``staging``: "whole-slices" or "split-slices" (a slice in pieces)."""
    from kvstrata.native.cuda_executor import CudaExecutor

    cache = ReferenceEngine(SMALL_32, num_blocks=64, block_size=16)
    try:
        layout = cache.layout
        if objects == "uneven":
            tokens, job = uneven_job(layout, 4, 20)
        else:
            tokens = [T] * 4
            job = planner.TransferJob(layout, [list(range(4 * T // 16))], planner.plan_copies(tokens, T, 0, 0))
        hosts, h = [], 1 << 40
        for n in tokens:
            hosts.append(h)
            h += layout.object_bytes(n)
        per_layer = layout.kv_size * job.num_tokens * layout.token_bytes_per_layer
        staging_bytes = per_layer * (width if staging == "whole-slices" else 2)
        slices = planner.layer_slices(layout.num_layers, width)
        events = [1000 + i for i in range(len(slices))]
        programs, pieces = [], []
        for batched in (False, True):
            engine = staged_engine(layout, staging_bytes, write_staged_slices)
            ex = CudaExecutor(engine, None, addresses=([x + (1 << 44) for x in hosts], hosts, tokens))
            issuer = engine.ext
            with issuer.program():  # the first slice, as the queue plans it
                ex.scatter(job, *slices[0])
                issuer.event_record(events[0], 11)
                issuer.mark()
            with issuer.program():
                if batched:
                    cells = ex.scatter_slices(job, slices[1:], events[1:])
                else:
                    cells = []
                    for (start, count), event in zip(slices[1:], events[1:]):
                        ex.scatter(job, start, count)
                        issuer.event_record(event, 11)
                        cells.append(issuer.mark())
            assert [c[0] for c in cells] == list(range(2, len(slices) + 1))
            programs.append(np.concatenate(issuer._native.programs))
            pieces.append((engine._piece, engine._used))
        assert programs[0].tolist() == programs[1].tolist()
        assert pieces[0] == pieces[1]  # the staging buffers' turn and use carry on to the next load alike
    finally:
        cache.close()


def assert_writer_refuses_what_it_cannot_write(write_staged_slices: Callable[..., tuple[int, int]]) -> None:
    """The writer checks what it is given: a slice past the last layer, a piece size it has no jobs for, or a
    program longer than its buffer is an error naming it, not words written past the end."""
    launch = np.asarray([12, 11, 1 << 48, 64, 2, 32, 64, 32, 32, 264, 0], dtype=np.int64)
    kinds = np.asarray([[1, 1 << 50, 16, 0, 1]], dtype=np.int64)
    jobs = np.asarray([[0, 4096, 1 << 40, 8192, 4096, 2, 4096]], dtype=np.int64)
    buffers = np.asarray([[1 << 46, 31, 21, 0], [(1 << 46) + (1 << 40), 32, 22, 0]], dtype=np.int64)
    out, marks = np.zeros(1024, dtype=np.int64), np.zeros(4, dtype=np.int64)

    def write(slices, capacity=len(out), layers_per_piece=1):
        s = np.asarray(slices, dtype=np.int64)
        return write_staged_slices(s.ctypes.data, len(s), layers_per_piece, kinds.ctypes.data, len(kinds),
                                   jobs.ctypes.data, buffers.ctypes.data, 2, 0, launch.ctypes.data, out.ctypes.data,
                                   capacity, marks.ctypes.data)

    words, written = write([[0, 1, 7], [1, 1, 8]])
    assert written == 2 and marks[:2].tolist() == [words // 2 - 3, words - 3]
    with pytest.raises(ValueError, match=r"slice \[31, 33\) is outside 32 layers"):
        write([[31, 2, 7]])
    with pytest.raises(ValueError, match="no piece kind of 2 layers"):
        write([[0, 2, 7]], layers_per_piece=4)
    with pytest.raises(ValueError, match="needs more than 10 words"):
        write([[0, 1, 7]], capacity=10)
