"""Engine-placement loads reach the GPU through a native thread, not through the engine process's Python threads.

A Python thread that issues a slice's driver calls needs the GIL for each of them, and an engine whose own thread
stays in Python (scheduling, launching) keeps the GIL up to CPython's 5 ms switch interval at a time: a load of
many thin slices then waited for the GIL once per call. Here the transfer queue's thread only *plans* a slice:
every call :class:`~kvstrata.native.cuda_executor.CudaExecutor` makes that enqueues GPU work (copy-engine jobs,
event records and waits, table uploads, kernel launches) is recorded into a program of integer words, and the
program is handed in one call to the copier's native :class:`LoadIssuer` thread (``native/csrc/load_issuer.h``),
which issues the driver calls in submission order without ever taking the GIL. The queue plans a load's slices one
after another without waiting on anything in between, so a load costs the engine process's Python one stretch of
planning, not one GIL hand-over per slice.

Each slice ends with its event's record and a *mark*. A slice's completion (:class:`IssuedSlice`) is handed to the
load's gate at once; it counts as landed only once its mark is issued and its event has completed, and a layer
wait that reaches it before the mark is issued waits for the mark natively (without the GIL) before it makes the
engine's stream wait on the event. An error the native thread meets stops that program: its marks are published as
failed, and whoever waits on them gets :class:`~kvstrata.core.arrival.gate.TransferFailed`.

Calls made outside a program (a store's copies, a table slot handed back) are issued through the same thread and
waited for before they return, so everything this copier puts on its streams keeps one order: the order in which
it was planned. That order is what makes the staging buffers' event hand-over (recorded at plan time) correct.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from kvstrata.core.arrival.gate import LayerWaitTimeout, TransferFailed

OP_MEMCPY2D, OP_MEMCPY, OP_WAIT_EVENT, OP_RECORD_EVENT, OP_COPY, OP_TABLE_FROM_HOST, OP_MARK = range(1, 8)
"""The op codes of ``native/csrc/load_issuer.h``."""

ISSUE_WAIT_S = 60.0
"""How long a wait for a slice's mark may take before it fails the load. Issuing a slice takes microseconds; the
driver blocks a call only while the stream's queue is full, i.e. behind copies already running. The bound only
catches a hung driver."""


def _words_at(address: int, count: int) -> np.ndarray:
    """A copy of ``count`` int64 words at a host address (the rows the executor packed for one call)."""
    return np.frombuffer((ctypes.c_int64 * count).from_address(address), dtype=np.int64).copy()


class _Program:
    """The ops one thread recorded since its program began; marks are numbered when it is submitted."""

    __slots__ = ("parts", "words", "marks", "mark_words")

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.words = 0
        """Words recorded so far (where the next part begins)."""
        self.marks: list[list[int]] = []
        """One cell per MARK op, in order: filled with the mark's number at submission."""
        self.mark_words: list[int] = []
        """Where each MARK op's number goes in the program's words, in the order of ``marks``."""

    def append(self, part: np.ndarray, marks_at: Sequence[int] = ()) -> list[list[int]]:
        """Add ``part``, whose MARK ops begin at ``marks_at`` inside it; returns those marks' cells."""
        cells = [[0] for _ in marks_at]
        self.marks.extend(cells)
        self.mark_words.extend(self.words + at + 2 for at in marks_at)
        self.parts.append(part)
        self.words += len(part)
        return cells


class LoadIssuer:
    """The extension as a copier's executors call it, with GPU work recorded into programs for one native thread.

    Methods named like the extension's (``memcpy2d_runs``, ``event_record``, ``copy``, ...) record inside a
    :meth:`program` and are issued (and waited for) at once outside one; every other attribute is the
    extension's own.
    """

    def __init__(self, ext: Any, device_index: int) -> None:
        self._ext = ext
        self._native = ext.LoadIssuer(device_index)
        self._lock = threading.RLock()
        """Held from a program's first recorded op to its submission: plans reach the GPU in the order made."""
        self._local = threading.local()
        self._next_mark = 1

    def __getattr__(self, name: str) -> Any:  # what does not enqueue GPU work: the extension itself
        return getattr(self._ext, name)

    # --- programs --------------------------------------------------------------------

    @contextlib.contextmanager
    def program(self) -> Iterator["LoadIssuer"]:
        """Record this thread's GPU work until the block ends, then hand it to the native thread in one call.

        Programs nest (an inner one joins the outer). On an exception nothing recorded is submitted, so a
        slice that failed half-planned issues nothing.
        """
        outer = getattr(self._local, "program", None)
        if outer is not None:
            yield self
            return
        with self._lock:
            self._local.program = _Program()
            try:
                yield self
                self._submit(self._local.program)
            finally:
                self._local.program = None

    def mark(self) -> list[int]:
        """Record a mark in this thread's program: a cell that holds its number once the program is submitted
        (see :class:`IssuedSlice`)."""
        return self._current().append(np.asarray([OP_MARK, 1, 0], dtype=np.int64), (0,))[0]

    def record_ops(self, words: np.ndarray, marks_at: Sequence[int]) -> list[list[int]]:
        """Inside a program: append ops already encoded as ``op, n_args, args...`` words (checked by the native
        thread when the program is submitted), with MARK ops beginning at the offsets ``marks_at``; returns those
        marks' cells, in order (see :meth:`mark`)."""
        return self._current().append(words, marks_at)

    def flush(self) -> None:
        """Submit what this thread recorded so far and wait until it, and every program submitted before it by any
        thread, is issued: before memory those ops use may be freed (a staging buffer replaced by a larger one).
        Also when this thread recorded nothing since its last hand-over: programs handed over earlier may still
        wait for the native thread, and a buffer freed under them could be handed out again before their copies
        reach its stream. Outside a program, waits for everything submitted so far."""
        with self.program():  # this thread's program, or one of its own outside one
            cell = self.mark()
            self.hand_over()
        self.wait_issued(cell[0])

    def hand_over(self) -> None:
        """Submit what this thread recorded so far and go on recording into a fresh program, without waiting for
        the issue (unlike :meth:`flush`): a slice's first copy goes to the GPU while the host still plans the
        slice's kernel. A no-op outside a program. Should the rest of the program fail, what was handed over still
        runs: a copy into a staging buffer, which only this copier's later pieces use, in stream order."""
        program = getattr(self._local, "program", None)
        if program is None or not program.parts:
            return
        self._submit(program)
        self._local.program = _Program()

    def discard(self) -> None:
        """Drop what this thread recorded since its program began or was last handed over: the rest of a slice
        that failed half-planned issues nothing. A no-op outside a program."""
        if getattr(self._local, "program", None) is not None:
            self._local.program = _Program()

    def issued(self, mark: int) -> bool:
        return mark != 0 and self._native.issued_mark() >= mark

    def wait_issued(self, mark: int, timeout: float = ISSUE_WAIT_S) -> None:
        """Block without the GIL until ``mark`` is issued; raise if it never will be."""
        if mark == 0:
            raise TransferFailed("a slice was waited on before its program was submitted")
        if not self._native.wait_mark(mark, int(timeout * 1e6)):
            raise LayerWaitTimeout(f"the copier's native thread did not issue a slice within {timeout:g} s")
        error = self._native.mark_error(mark)
        if error:
            raise TransferFailed(f"issuing a slice's copies failed: {error}")

    def failed(self, mark: int) -> bool:
        return bool(self._native.mark_error(mark))

    def close(self) -> None:
        """Issue what is queued and stop the native thread."""
        self._native.close()

    def _current(self) -> _Program:
        program = getattr(self._local, "program", None)
        if program is None:
            raise RuntimeError("LoadIssuer.mark() outside a program")
        return program

    def _submit(self, program: _Program) -> None:
        if not program.parts:
            return
        words = np.concatenate(program.parts)
        # Number the marks now, under the lock: issued marks then increase in submission order.
        first, n = self._next_mark, len(program.marks)
        words[program.mark_words] = np.arange(first, first + n, dtype=np.int64)
        for number, cell in enumerate(program.marks, first):
            cell[0] = number
        self._next_mark += n
        self._native.submit(words.ctypes.data, len(words))

    def _record(self, *ops: Any) -> None:
        program = getattr(self._local, "program", None)
        part = np.asarray(ops, dtype=np.int64) if not isinstance(ops[-1], np.ndarray) else \
            np.concatenate([np.asarray(ops[:-1], dtype=np.int64), ops[-1]])
        if program is not None:
            program.append(part)
            return
        with self.program():  # outside a program: issued now, and waited for
            self._local.program.append(part)
            cell = self.mark()
        self.wait_issued(cell[0])

    # --- the extension's calls that enqueue GPU work ---------------------------------

    def memcpy2d_runs(self, rows: int, n_rows: int, device: int, stream: int) -> None:
        self._record(OP_MEMCPY2D, 2 + 6 * n_rows, stream, n_rows, _words_at(rows, 6 * n_rows))

    def memcpy_runs(self, runs: int, n_runs: int, device: int, stream: int) -> None:
        self._record(OP_MEMCPY, 2 + 3 * n_runs, stream, n_runs, _words_at(runs, 3 * n_runs))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._record(OP_WAIT_EVENT, 2, stream, event)

    def event_record(self, event: int, stream: int) -> None:
        self._record(OP_RECORD_EVENT, 2, event, stream)

    def copy(self, scatter: bool, planes: int, tokens: int, src_base: int, n_tok: int, kv: int, num_layers: int,
             layer_offset: int, staged_layers: int, src_layers: int, src_layer0: int, row_bytes: int,
             head_bytes: int, head_stride: int, vec_bytes: int, max_ctas: int, device: int, stream: int) -> None:
        self._record(OP_COPY, 18, int(scatter), planes, tokens, src_base, n_tok, kv, num_layers, layer_offset,
                     staged_layers, src_layers, src_layer0, row_bytes, head_bytes, head_stride, vec_bytes, max_ctas,
                     device, stream)

    def build_table_from_host(self, host: int, n_copies: int, n_blocks: int, dev: int, row_bytes: int,
                              block_size: int, block_stride: int, token_stride: int, n_tok: int, device: int,
                              stream: int) -> None:
        self._record(OP_TABLE_FROM_HOST, 10, host, n_copies, n_blocks, dev, row_bytes, block_size, block_stride,
                     token_stride, n_tok, stream)


class IssuedSlice:
    """A slice's completion as its layer wait and release see it: its event, valid once its mark is issued.

    Quacks like the ``torch.cuda.Event`` the event backend expects: ``query`` (landed), ``wait(stream)`` (what
    ``Stream.wait_event`` calls) and ``synchronize``.
    """

    __slots__ = ("issuer", "mark", "event", "handle", "recycle")

    def __init__(self, issuer: LoadIssuer, mark: list[int], event: Any,
                 recycle: Callable[[Any], None] | None = None) -> None:
        """``recycle(event)``: called once nothing refers to this slice any more (its load and gate are gone, so no
        wait or query can reach the event): the copier reuses the event for a later slice."""
        self.issuer = issuer
        self.mark = mark
        self.event = event
        """The ``torch.cuda.Event`` recorded by the program (kept alive with the slice)."""
        self.handle = int(event.cuda_event)
        self.recycle = recycle

    def __del__(self) -> None:
        if self.recycle is not None:
            try:
                self.recycle(self.event)
            except Exception:  # at interpreter exit the copier may be gone
                pass

    def query(self) -> bool:
        """Issued and complete. A slice whose program failed never lands (its load fails when settled)."""
        mark = self.mark[0]
        if not self.issuer.issued(mark) or self.issuer.failed(mark):
            return False
        return bool(self.issuer.event_query(self.handle))

    def wait(self, stream: Any) -> None:
        """Make ``stream`` wait on the GPU for this slice (after waiting, without the GIL, for its issue)."""
        self.issuer.wait_issued(self.mark[0])
        self.issuer._ext.stream_wait_event(stream.cuda_stream, self.handle)

    def synchronize(self) -> None:
        """Block without the GIL until this slice's copies have run."""
        self.issuer.wait_issued(self.mark[0])
        self.issuer._ext.event_synchronize(self.handle)
