"""The native issuer's program for a load's staged slices, built with array operations.

In staged mode each piece of a slice is: wait until its staging buffer is idle, copy host -> staging on the copy
stream, hand the filled buffer to the kernel stream, scatter it into the engine's cache, mark the buffer idle; each
slice ends with its event's record and a mark (:class:`~kvstrata.native.load_issuer.LoadIssuer`). A long load of
thin slices has one piece per slice and layer (an 80-layer model loaded one layer a slice: 80 pieces), and the
rest of a load is planned on the engine's thread when its LOOKUP located it: every Python operation per piece is
paid before the engine may poll for the release. So the pieces of one size are written as the rows of one array,
their varying words (staging address, layer, buffer events) filled a column at a time, and only the order is
assembled piece by piece.

Pure integer work, no CUDA: the executor (:meth:`~kvstrata.native.cuda_executor.CudaExecutor.scatter_slices`)
passes the addresses and handles in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvstrata.native.load_issuer import OP_COPY, OP_MARK, OP_MEMCPY2D, OP_RECORD_EVENT, OP_WAIT_EVENT


@dataclass(frozen=True)
class PieceTemplate:
    """The copy-engine jobs and the scatter table of a piece of one size (its layer count)."""

    jobs: np.ndarray
    """``[rows, 6]`` int64 ``dst, dpitch, src, spitch, width, height`` jobs of the piece at layer 0 with staging
    at address 0 (host to staging: the destination is the staging side)."""
    host_shift: int | np.ndarray
    """How far each job's host side moves per layer: one int, or one per job."""
    table: int
    """The device address of the piece size's token table."""
    vec: int
    """The scatter kernel's vector width for it."""


@dataclass(frozen=True)
class StagedStreams:
    """What every piece of a copier names: its streams, staging buffers and their events, the scatter's
    fixed arguments."""

    copy_stream: int
    kernel_stream: int
    stages: Sequence[int]
    """Each staging buffer's device address."""
    idle_events: Sequence[int]
    """Per buffer: recorded once its last scatter is enqueued (the next copy into it waits on it)."""
    filled_events: Sequence[int]
    """Per buffer: recorded once its copy is enqueued (the scatter waits on it)."""
    planes: int
    n_tok: int
    kv: int
    num_layers: int
    row_bytes: int
    head_bytes: int
    head_stride: int
    max_ctas: int
    device: int


def staged_slices_words(streams: StagedStreams, pieces: Sequence[Sequence[tuple[int, int]]],
                        templates: dict[int, PieceTemplate], slice_events: Sequence[int], first_buffer: int,
                        used: Sequence[bool]) -> tuple[np.ndarray, list[bool]]:
    """The program's words for ``pieces`` (per slice, its ``(first layer, layers)`` pieces), each slice ending
    with the record of its event in ``slice_events`` and a mark; the pieces take the staging buffers in turn from
    ``first_buffer``. A copy waits for its buffer to be idle only where the buffer was used before (``used``, per
    buffer). Returns the words and which buffers are used after them."""
    s = streams
    n_buffers = len(s.stages)
    flat = [piece for slice_pieces in pieces for piece in slice_pieces]
    n = len(flat)
    firsts = np.fromiter((first for first, _ in flat), dtype=np.int64, count=n)
    sizes = np.fromiter((count for _, count in flat), dtype=np.int64, count=n)
    buffers = (first_buffer + np.arange(n, dtype=np.int64)) % n_buffers
    stage = np.asarray(s.stages, dtype=np.int64)[buffers]
    idle = np.asarray(s.idle_events, dtype=np.int64)[buffers]
    filled = np.asarray(s.filled_events, dtype=np.int64)[buffers]

    bodies: dict[int, np.ndarray] = {}
    row_in_body = np.empty(n, dtype=np.int64)
    for size in np.unique(sizes).tolist():
        chosen = np.flatnonzero(sizes == size)
        row_in_body[chosen] = np.arange(len(chosen))
        bodies[size] = _piece_bodies(s, templates[size], size, firsts[chosen], stage[chosen], idle[chosen],
                                     filled[chosen])
    waits = np.empty((n, 4), dtype=np.int64)
    waits[:] = (OP_WAIT_EVENT, 2, s.copy_stream, 0)
    waits[:, 3] = idle
    tails = np.empty((len(pieces), 7), dtype=np.int64)
    tails[:] = (OP_RECORD_EVENT, 2, 0, s.kernel_stream, OP_MARK, 1, 0)
    tails[:, 2] = slice_events

    if all(used) and len(bodies) == 1 and n == len(pieces):  # one piece a slice, one size, every buffer used
        body = next(iter(bodies.values()))
        return np.hstack([waits, body, tails]).ravel(), list(used)
    used_now = list(used)
    parts: list[np.ndarray] = []
    index = 0
    for slice_index, slice_pieces in enumerate(pieces):
        for _ in slice_pieces:
            buffer = int(buffers[index])
            if used_now[buffer]:
                parts.append(waits[index])
            used_now[buffer] = True
            parts.append(bodies[int(sizes[index])][row_in_body[index]])
            index += 1
        parts.append(tails[slice_index])
    return np.concatenate(parts), used_now


def _piece_bodies(s: StagedStreams, template: PieceTemplate, size: int, firsts: np.ndarray, stage: np.ndarray,
                  idle: np.ndarray, filled: np.ndarray) -> np.ndarray:
    """One row per piece of ``size`` layers: its copy, the hand-over to the kernel stream, its scatter and the
    record that its buffer is idle again."""
    jobs = np.asarray(template.jobs, dtype=np.int64).reshape(-1, 6)
    n_jobs = len(jobs)
    rows = np.broadcast_to(jobs, (len(firsts), n_jobs, 6)).copy()
    rows[:, :, 0] += stage[:, None]  # the staging side
    rows[:, :, 2] += firsts[:, None] * np.asarray(template.host_shift, dtype=np.int64)  # the host side
    copy_words = 4 + 6 * n_jobs
    body = np.empty((len(firsts), copy_words + 32), dtype=np.int64)
    body[:, :4] = (OP_MEMCPY2D, 2 + 6 * n_jobs, s.copy_stream, n_jobs)
    body[:, 4:copy_words] = rows.reshape(len(firsts), -1)
    o = copy_words
    body[:, o:o + 8] = (OP_RECORD_EVENT, 2, 0, s.copy_stream, OP_WAIT_EVENT, 2, s.kernel_stream, 0)
    body[:, o + 2] = filled
    body[:, o + 7] = filled
    o += 8
    body[:, o:o + 20] = (OP_COPY, 18, 1, s.planes, template.table, 0, s.n_tok, s.kv, s.num_layers, 0, size, size, 0,
                         s.row_bytes, s.head_bytes, s.head_stride, template.vec, s.max_ctas, s.device,
                         s.kernel_stream)
    body[:, o + 5] = stage
    body[:, o + 9] = firsts
    o += 20
    body[:, o:o + 4] = (OP_RECORD_EVENT, 2, 0, s.kernel_stream)
    body[:, o + 2] = idle
    return body
