"""GPU executors: run the planner's transfer plans between a pinned host L1 pool and an engine's cache.

One :class:`CudaTransferEngine` per registered engine cache (per GPU), one
executor per transfer. Three modes, chosen per engine (:class:`CudaTransferConfig`; ``kvstrata serve
--cuda-mode`` sets it for every engine of a server):

``staged`` (default)
    The copy engine moves each slice of every object (``kv`` contiguous ranges
    per object) into a device staging buffer sized to the slice (capped, never
    to all layers of a chunk), double-buffered on a second stream, and the
    scatter kernel writes it into the engine's layout. The ranges of a slice are
    folded into as few copy-engine jobs as possible (:func:`plan_dma`): objects
    sit back to back in the pool, so a slice is normally one 2D copy, and the
    copy engine runs at the raw memcpy rate whatever the slice width. Where the
    engine's layout is dense token rows in consecutive blocks the copy engine
    writes the engine's cache directly and no kernel runs. So a retrieve's GPU
    time stays close to one raw memcpy of the same bytes at any width, and a
    store's too (``benchmarks/transfer.py``).

``kernel``
    The scatter kernel reads the L1 objects in place, through the device
    pointer of the pinned pool, and writes the engine's layout: one launch per
    slice and no staging at all, but SM loads over PCIe are slower than the
    copy engine, and it occupies SMs the engine computes on. Hybrid layouts (several KV groups) always take this path.

``torch``
    The pure-torch reference functions on GPU tensors: slow, for when the
    extension cannot be built, and as the GPU oracle in tests.

Per transfer the host writes only the copies' descriptors and the block table;
the per-token address table is expanded on the device once and reused by every
slice, so a slice costs the host a few calls whatever its size.

Every mode implements the planner's :class:`~kvstrata.core.transfer.planner.Executor`
protocol, so the chunk-major and layer-major plans run unchanged.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import operator
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

import numpy as np
import torch

from kvstrata.core.store.l1_store import span_view
from kvstrata.core.transfer.layouts import LayoutError, PagedKVLayout
from kvstrata.core.transfer.planner import ChunkCopy, TransferJob
from kvstrata.native.host_pinning import PoolPinning, pinned_device_pointer
from kvstrata.native.load_issuer import IssuedSlice, LoadIssuer

log = logging.getLogger(__name__)

MODES = ("kernel", "staged", "torch")
_MAX_VEC = 16


ENGINE_COPY_PRIORITY = 0
"""The stream priority of an engine's own copies (:class:`CudaLocalCopier`): normal, CUDA's default; the highest
(-1) measured no better with the engine computing (see the class)."""

NO_DIRECT_COPIES = 1 << 62
"""A ``direct_copy_min_run`` no run reaches: always stage."""


@dataclass
class CudaTransferConfig:
    """How a GPU engine copies. ``kvstrata serve --cuda-mode`` picks the mode for A/B measurements; the
    defaults are what a server runs with."""

    mode: str = "staged"
    """One of :data:`MODES` (see the module docstring)."""
    max_ctas: int = 0
    """Upper bound on thread blocks per launch; 0 means two per SM."""
    staging_bytes: int = 64 << 20
    """Staged mode: the most bytes one staging buffer may hold; slices larger than this are split."""
    staging_buffers: int = 2
    """Staged mode: how many staging buffers the copies take turns on (the copy engine fills one while the scatter
    kernel empties another; more let the copy engine run further ahead of a kernel that waits for SMs)."""
    direct_copy_min_run: int = 256 << 10
    """Staged mode: write the engine directly with the copy engine when the average contiguous run is at least this
    (``NO_DIRECT_COPIES``: never)."""
    stream_priority: int = 0
    """Of the copy and kernel streams (lower is higher; -1 is the highest). Normal (0) for a server's copies and
    for an engine's own (:data:`ENGINE_COPY_PRIORITY`)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.max_ctas < 0 or self.staging_bytes <= 0 or self.staging_buffers < 2:
            raise ValueError("max_ctas must be >= 0, staging_bytes > 0 and staging_buffers >= 2")


def _vec_bytes(*values: int) -> int:
    """The widest power-of-two access (<= 16 bytes) that divides every address and stride given."""
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    if g == 0:
        return _MAX_VEC
    return min(_MAX_VEC, g & -g)


# --- copy-engine jobs ------------------------------------------------------------------

_MAX_PITCH = (1 << 31) - 1


def plan_dma(rows: Sequence[tuple[int, int, int]] | np.ndarray) -> np.ndarray:
    """Fold ``(dst, src, bytes)`` ranges into as few copy-engine jobs as possible.

    Each job costs the copy engine a few microseconds whatever its size, so a
    layer slice issued as one job per (object, plane) range would cost more in
    job overhead than it moves. Adjacent ranges are merged, then runs of
    equal-width ranges at a constant source and destination stride become one
    2D copy: the L1 objects of a retrieve usually sit back to back in the pool,
    so a whole slice is typically a single job. Returns ``[jobs, 6]`` rows of
    ``dst, dpitch, src, spitch, width, height``.
    """
    if len(rows) > 1:
        # The common case, checked at C speed: equal widths at one source and one
        # destination stride (every object's slice, objects back to back) is one job.
        a = np.asarray(rows, dtype=np.int64)
        dd, ds = np.diff(a[:, 0]), np.diff(a[:, 1])
        n0 = int(a[0, 2])
        if (a[:, 2] == n0).all() and (dd == dd[0]).all() and (ds == ds[0]).all():
            if dd[0] == n0 and ds[0] == n0:
                return np.asarray([[a[0, 0], n0 * len(a), a[0, 1], n0 * len(a), n0 * len(a), 1]], dtype=np.int64)
            if n0 <= dd[0] <= _MAX_PITCH and n0 <= ds[0] <= _MAX_PITCH:
                return np.asarray([[a[0, 0], dd[0], a[0, 1], ds[0], n0, len(a)]], dtype=np.int64)
    merged: list[list[int]] = []
    for d, src, n in (rows.tolist() if isinstance(rows, np.ndarray) else rows):
        if merged and merged[-1][0] + merged[-1][2] == d and merged[-1][1] + merged[-1][2] == src:
            merged[-1][2] += n
        else:
            merged.append([d, src, n])
    jobs: list[list[int]] = []
    for d, src, n in merged:
        if jobs and jobs[-1][4] == n and n <= _MAX_PITCH:
            j = jobs[-1]
            if j[5] == 1:
                dp, sp = d - j[0], src - j[2]
                if n <= dp <= _MAX_PITCH and n <= sp <= _MAX_PITCH:
                    j[1], j[3], j[5] = dp, sp, 2
                    continue
            elif d == j[0] + j[1] * j[5] and src == j[2] + j[3] * j[5]:
                j[5] += 1
                continue
        jobs.append([d, n, src, n, n, 1])
    return np.asarray(jobs, dtype=np.int64).reshape(-1, 6)


def back_to_back_job(layout: PagedKVLayout, row_bytes: int, tokens: int, hosts: Sequence[int], count: int,
                     to_device: bool) -> tuple[int, int, int, int, int, int] | None:
    """The copy-engine job moving layers ``[0, count)`` of objects of ``tokens`` tokens at host addresses
    ``hosts`` to (or from) a staging buffer at 0, as one 2D copy, when the objects sit back to back in the pool;
    else None.

    The usual case (the store allocates a prompt's chunks in order): each (object, plane) slice is then one row
    of a single 2D copy whose source pitch is a plane. Worked out with a few integer operations, where the
    general planner's array set-up costs tens of microseconds on the way to the first copy."""
    plane, piece = layout.num_layers * tokens * row_bytes, count * tokens * row_bytes
    stride = layout.kv_size * plane
    if plane > _MAX_PITCH or any(b - a != stride for a, b in zip(hosts, hosts[1:])):
        return None
    rows = len(hosts) * layout.kv_size
    return (0, piece, hosts[0], plane, piece, rows) if to_device else (hosts[0], plane, 0, piece, piece, rows)


@dataclass
class _TableSlot:
    """A pinned host area for a transfer's descriptors and block table, and the device buffer they are
    uploaded to and expanded in. Leased by one executor for its transfer; ``done`` is recorded when it is
    handed back, and the slot is reused once that point has run on the GPU."""

    host: torch.Tensor
    dev: torch.Tensor
    done: Any
    done_handle: int
    busy: bool = True
    host_np: Any = field(init=False)  # the pinned words as numpy (struct packs into it) and the raw addresses
    host_ptr: int = field(init=False)
    dev_ptr: int = field(init=False)

    def __post_init__(self) -> None:
        self.host_np = self.host.numpy()
        self.host_ptr = self.host.data_ptr()
        self.dev_ptr = self.dev.data_ptr()


# --- the engine ----------------------------------------------------------------------


class CudaTransferEngine:
    """Copies between pinned host L1 objects and one engine's paged KV cache on one GPU.

    ``regions`` are the cache's memory regions as flat uint8 CUDA tensors (opened
    from CUDA IPC by the server, or local tensors in-process); ``pool`` is the L1
    pool (a CPU uint8 tensor), pinned here once. All copies run on ``stream``.
    """

    def __init__(self, layout: PagedKVLayout, regions: Sequence[torch.Tensor], pool: torch.Tensor | None,
                 device_index: int, config: CudaTransferConfig | None = None, *, pool_read_only: bool = False,
                 pin_in_background: bool = False) -> None:
        """``pool_read_only``: this process maps the pool read-only (an engine's view of the server's L1).
        ``pin_in_background``: register the pool on a thread of its own while copies already run
        (:class:`~kvstrata.native.host_pinning.PoolPinning`); honoured where every copy reads the pool through the
        copy engine (staged mode, one KV group), since kernels reading it in place need it registered first."""
        self.layout = layout
        self.config = config or CudaTransferConfig()
        self.index = device_index
        self.device = torch.device("cuda", device_index)
        self.regions = list(regions)
        if layout.plane_strides:
            raise LayoutError(f"{layout.format}: planes addressed apart (plane_strides) are copied on CPU only")
        if len(self.regions) != len(layout.regions):
            raise ValueError(f"{len(self.regions)} region tensors for a layout with {len(layout.regions)} regions")
        for i, (t, r) in enumerate(zip(self.regions, layout.regions)):
            if t.device != self.device or t.dtype != torch.uint8 or t.dim() != 1 or t.numel() < r.size:
                raise ValueError(f"region {i} must be a flat uint8 tensor of at least {r.size} bytes on "
                                 f"{self.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
        self.ext: Any = None
        if self.config.mode != "torch":
            from . import cuda_ext

            self.ext = cuda_ext.load()
        self.pool = pool if self.ext is not None else None
        self._pool_range = (0, 0, 0)  # host base, size, device base: object addresses by arithmetic
        self.pinning: PoolPinning | None = None
        if self.pool is not None:
            background = pin_in_background and self.config.mode == "staged" and not layout.is_hybrid
            self.pinning = PoolPinning(self.pool, device_index, self.ext, read_only=pool_read_only,
                                       background=background)
            self._pool_range = (self.pool.data_ptr(), self.pool.numel(), self.pinning.dev_base)
        with torch.cuda.device(device_index):
            priority = self.config.stream_priority
            self.stream = torch.cuda.Stream(device_index, priority=priority)
            self.copy_stream = torch.cuda.Stream(device_index, priority=priority) \
                if self.config.mode == "staged" else None
        L, kv = layout.num_layers, layout.kv_size
        addrs = [self.regions[r].data_ptr() + off for per_kv in layout.offsets for (r, off) in per_kv]
        self._plane_addrs = np.asarray(addrs, dtype=np.uint64)
        with torch.cuda.device(device_index):
            self.planes = torch.tensor(np.asarray(addrs, dtype=np.int64), device=self.device)
        self.row_bytes = layout.token_bytes_per_layer
        self.layout_vec = _vec_bytes(layout.head_bytes, layout.head_stride, layout.token_stride,
                                     layout.block_stride, self.row_bytes, *addrs)
        self.max_ctas = self.config.max_ctas or (2 * self.ext.sm_count(device_index) if self.ext else 0)
        self.dense_rows = (layout.head_stride == layout.head_bytes and layout.token_stride == self.row_bytes
                           and layout.block_stride == layout.block_size * self.row_bytes
                           and not layout.is_hybrid)
        self._staging: list[torch.Tensor] = []
        self._stage_lock = threading.RLock()
        """Held while staging buffers are handed out and used; re-entered by a load whose first layer was staged
        ahead (:class:`StagedFirstLayer` holds it from that copy until the layer's scatter is planned)."""
        self._piece = 0
        if self.config.mode == "staged":
            with torch.cuda.device(device_index):
                # Per staging buffer: `_idle[b]` marks everything that touched it so far, `_filled[b]`
                # the hand-over between the copy stream and the kernel stream inside one piece.
                # Used through their raw handles (see `_event`).
                n = self.config.staging_buffers
                self._idle = [self._event() for _ in range(n)]
                self._filled = [self._event() for _ in range(n)]
            self._idle_h = [ev.cuda_event for ev in self._idle]
            self._filled_h = [ev.cuda_event for ev in self._filled]
            self._job_row = np.zeros(6, dtype=np.int64)  # one packed copy-engine job (under _stage_lock)
            self._job_row_addr = self._job_row.ctypes.data
            self._used = [False] * n
        self._table_slots: list[_TableSlot] = []
        self._table_lock = threading.Lock()
        self.before_buffer_change: Callable[[], None] = lambda: None
        """Called before a staging buffer is replaced by a larger one: where GPU work is issued later than it is
        planned (:class:`~kvstrata.native.load_issuer.LoadIssuer`), what was planned on the old buffer must reach
        its stream first, since the allocator may hand its memory out again at once."""
        self.copy_planned: Callable[[], None] = lambda: None
        """Called once a staged slice's first host-to-staging copy is planned, before the host builds the slice's
        token table: where GPU work is issued later than it is planned, that copy goes to the GPU at once
        (:meth:`~kvstrata.native.load_issuer.LoadIssuer.hand_over`) instead of waiting for the table."""
        assert len(addrs) == L * kv

    # --- executors -------------------------------------------------------------------

    def executor(self, objects: Sequence[torch.Tensor]) -> "CudaExecutor | TorchCudaExecutor":
        if self.config.mode == "torch":
            return TorchCudaExecutor(self, objects)
        return CudaExecutor(self, objects)

    def pool_executor(self, spans: Sequence[tuple[int, int]]) -> "CudaExecutor":
        """An executor for L1 objects given as (offset in the pinned pool, tokens).

        The server's path: it knows where its objects are, and addresses by
        arithmetic cost nothing, where a tensor view per object costs microseconds
        each on the way to the first copy. The objects' shapes were checked against
        the layout when they were located.
        """
        if self.pool is None:
            raise RuntimeError("pool_executor needs the pinned L1 pool (not available in torch mode)")
        base, size, dev_base = self._pool_range
        L = self.layout
        row_bytes = L.kv_size * L.num_layers * self.row_bytes
        for off, tokens in spans:
            if not (0 <= off and off + tokens * row_bytes <= size):
                raise ValueError(f"L1 object at offset {off} with {tokens} tokens lies outside the {size}-byte pool")
        return CudaExecutor(self, None, addresses=([dev_base + off for off, _ in spans],
                                                   [base + off for off, _ in spans], [t for _, t in spans]))

    def staging(self, which: int, nbytes: int) -> torch.Tensor:
        """Staging buffer ``which`` (of ``config.staging_buffers``) with at least ``nbytes``; grown on demand, never
        preallocated."""
        while len(self._staging) <= which:
            self._staging.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        buf = self._staging[which]
        if buf.numel() < nbytes:
            self.before_buffer_change()
            with torch.cuda.device(self.index), torch.cuda.stream(self.stream):
                buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                buf.record_stream(self.copy_stream)  # used there too: freeing must wait for both streams
            self._staging[which] = buf
        return buf

    def _event(self) -> torch.cuda.Event:
        """An ordinary event, created and recorded once so that its raw handle (``cuda_event``) exists.

        The per-slice path records and waits on events through the extension's raw
        calls: after a transfer's worth of idle time, torch's Python wrappers cost
        several times the driver call on the way to the first slice.
        """
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def build_table(self, copies: list[tuple[int, int, int, int, int]], blocks: Sequence[int],
                    n_tok: int) -> tuple[int, _TableSlot]:
        """The per-token ``[n_tok, 3]`` table of a transfer, built on the device from its copies and block table.

        Returns the table's device address and the slot holding it, which the caller
        hands back (:meth:`release_table`) once its last launch is enqueued. The host
        packs only the copies' descriptors and the block table (a few KiB, whatever
        the transfer's length) into the slot's pinned memory; one extension call
        uploads them and expands them on the stream. Slots are reused, so the path to
        a transfer's first slice allocates nothing: on a host that idled between
        transfers, numpy's conversions, a device allocation and torch's event wrappers
        made this step several times slower (``profile_host.py --table-steps``).
        """
        n_copies, n_blocks = len(copies), len(blocks)
        need = 5 * n_copies + n_blocks
        slot = self._lease_table(need, need + 3 * n_tok)
        struct.pack_into(f"<{need}q", slot.host_np, 0, *itertools.chain.from_iterable(copies), *blocks)
        lay = self.layout
        base = slot.dev_ptr
        self.ext.build_table_from_host(slot.host_ptr, n_copies, n_blocks, base, self.row_bytes,
                                       lay.block_size, lay.block_stride, lay.token_stride, n_tok, self.index,
                                       self.stream.cuda_stream)
        return base + 8 * need, slot

    def _lease_table(self, host_words: int, dev_words: int) -> _TableSlot:
        with self._table_lock:
            for slot in self._table_slots:
                if (not slot.busy and slot.host.numel() >= host_words and slot.dev.numel() >= dev_words
                        and self.ext.event_query(slot.done_handle)):
                    slot.busy = True
                    return slot
            # Grown on demand and kept: the first transfers of a process pay the allocations.
            host = torch.empty(max(host_words, 1 << 15), dtype=torch.int64, pin_memory=True)
            # From this copier's kernel stream, which uploads and reads the table: allocated on the calling
            # thread's stream (the engine's, when a load is planned on its thread), it could be a block the
            # engine just freed with its kernels still queued, which would then overwrite the table.
            with torch.cuda.device(self.index), torch.cuda.stream(self.stream):
                dev = torch.empty(max(dev_words, 3 << 15), dtype=torch.int64, device=self.device)
            done = self._event()
            slot = _TableSlot(host, dev, done, done.cuda_event)
            self._table_slots.append(slot)
            return slot

    def copy_into_staging(self, buffer: int, rows: int, n_rows: int) -> None:
        """Call under ``_stage_lock``: the copy stream copies ``n_rows`` packed jobs (host address ``rows``) into
        staging ``buffer`` once whatever used it last is done, and records the buffer filled."""
        copy_s = self.copy_stream.cuda_stream
        if self._used[buffer]:
            self.ext.stream_wait_event(copy_s, self._idle_h[buffer])
        self.ext.memcpy2d_runs(rows, n_rows, self.index, copy_s)
        self.ext.event_record(self._filled_h[buffer], copy_s)
        self._used[buffer] = True

    def abandon_staging(self, buffer: int) -> None:
        """Planning failed after a copy into staging ``buffer`` (which waited for the buffer's last user) went to
        the GPU, before that piece's scatter did: the buffer is idle once that copy has run (the copy stream
        records it), so a later piece waits for the copy, not for a scatter that never comes. Through a
        :class:`LoadIssuer`, what the failed plan recorded since its last hand-over is dropped first."""
        if isinstance(self.ext, LoadIssuer):  # recorded ops reach the GPU only when handed over
            self.ext.discard()
            self.ext.event_record(self._idle_h[buffer], self.copy_stream.cuda_stream)
            self.ext.hand_over()
        else:
            self.ext.event_record(self._idle_h[buffer], self.copy_stream.cuda_stream)

    def release_table(self, slot: _TableSlot) -> None:
        """Hand a table slot back once everything using it is enqueued: reusable after that has run."""
        self.ext.event_record(slot.done_handle, self.stream.cuda_stream)
        with self._table_lock:
            slot.busy = False

    def object_addresses(self, objects: Sequence[torch.Tensor]) -> tuple[list[int], list[int], list[int]]:
        """(device address, host address, tokens) of each L1 object, checking its shape on the way.

        Runs once per transfer on the path to the first slice, so it costs a few
        attribute reads per object and address arithmetic inside the pinned pool.
        """
        kv, L, H, hb = self.layout.shape_signature()
        base, size, dev_base = self._pool_range
        dev, host, tokens = [], [], []
        for i, o in enumerate(objects):
            shape = o.shape
            if (o.dtype != torch.uint8 or len(shape) != 5 or shape[0] != kv or shape[1] != L or shape[3] != H
                    or shape[4] != hb or not o.is_contiguous()):
                raise ValueError(f"L1 object {i} must be a contiguous uint8 [kv={kv}, layers={L}, tokens, "
                                 f"heads={H}, head_bytes={hb}] tensor, got {tuple(shape)} {o.dtype}")
            p = o.data_ptr()
            host.append(p)
            tokens.append(shape[2])
            dev.append(dev_base + (p - base) if base <= p < base + size
                       else pinned_device_pointer(p, self.index, self.ext))
        return dev, host, tokens

    def synchronize(self) -> None:
        """Block until every copy enqueued so far, on both streams, is complete."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        self.stream.synchronize()

    def close(self) -> None:
        """Wait for queued copies, then release staging, regions and this engine's pin of the pool."""
        self.synchronize()
        self._staging.clear()
        self._table_slots.clear()
        self.regions.clear()
        if self.pool is not None:
            self.pinning.close()
            self.pool = None


def _check_objects(layout: PagedKVLayout, objects: Sequence[torch.Tensor]) -> None:
    kv, L, H, hb = layout.shape_signature()
    for i, o in enumerate(objects):
        if (o.dtype != torch.uint8 or o.dim() != 5 or tuple(o.shape[:2]) != (kv, L)
                or tuple(o.shape[3:]) != (H, hb) or not o.is_contiguous()):
            raise ValueError(f"L1 object {i} must be a contiguous uint8 [kv={kv}, layers={L}, tokens, heads={H}, "
                             f"head_bytes={hb}] tensor, got {tuple(o.shape)} {o.dtype}")


class CudaExecutor:
    """Runs one transfer's plan with the CUDA kernels (``kernel`` or ``staged`` mode)."""

    name = "cuda"

    def __init__(self, engine: CudaTransferEngine, objects: Sequence[torch.Tensor] | None, *,
                 addresses: tuple[list[int], list[int], list[int]] | None = None) -> None:
        """``objects`` as tensor views, or ``addresses`` as (device, host, tokens) lists (see pool_executor)."""
        self.engine = engine
        if addresses is None:
            if objects is None:
                raise ValueError("CudaExecutor needs objects or addresses")
            addresses = engine.object_addresses(objects)
        self._obj_dev, self._obj_host, self._obj_tokens = addresses
        self._job: TransferJob | None = None
        self._first: list[int] = []
        self._total = 0
        self._uniform = 0  # tokens per object when every copy is a whole object of that size
        self._tables: dict[Any, Any] = {}
        self._leased: list[_TableSlot] = []
        self.staged_first: StagedFirstLayer | None = None
        """Layer 0's copy into a staging buffer, handed to the GPU before this transfer was planned
        (:meth:`CudaLocalCopier.stage_first_layer`): the scatter of layer 0 reads it instead of copying again."""

    def close(self) -> None:
        """Hand back this transfer's table slots; call once its last launch is enqueued (or it was abandoned)."""
        leased, self._leased = self._leased, []
        for slot in leased:
            self.engine.release_table(slot)

    def __del__(self) -> None:  # an executor dropped without close() must not keep its slots forever
        try:
            if self._leased:
                self.close()
        except Exception:  # the context may be gone at interpreter exit
            pass

    # --- per-job tables (built once, reused by every slice) ---------------------------

    def _bind(self, job: TransferJob) -> int:
        """Attach the executor to ``job`` (tables are per job); returns its token count."""
        if self._job is not job:
            if job.layout is not self.engine.layout and job.layout != self.engine.layout:
                raise ValueError("the transfer job's layout is not the engine's registered layout")
            self._job = job
            self._tables.clear()
            first, total = [], 0
            for c in job.copies:
                first.append(total)
                total += c.num_tokens
            self._first, self._total = first, total
            T0 = self._obj_tokens[job.copies[0].object_index] if job.copies else 0
            self._uniform = T0 if all(c.src_token_start == 0 and c.num_tokens == T0 == self._obj_tokens[c.object_index]
                                      for c in job.copies) else 0
            lay = self.engine.layout
            for g, ids in enumerate(job.block_ids):
                end = max(c.dst_position + c.num_tokens for c in job.copies) if job.copies else 0
                if end > len(ids) * lay.block_size:
                    raise ValueError(f"group {g}: {len(ids)} block ids cover {len(ids) * lay.block_size} positions, "
                                     f"the transfer writes up to position {end}")
        return self._total

    def _table(self, job: TransferJob, group: int, slots: int | None) -> tuple[int, int]:
        """The per-token table's device address and vector width, for reading the objects in place (``slots=None``) or
        for a staging buffer laid out per copy as ``[kv, slots, tokens, row]``."""
        key = (group, slots)
        hit = self._tables.get(key)
        if hit is not None:
            return hit
        n_tok = self._bind(job)
        e, row, kv = self.engine, self.engine.row_bytes, self.engine.layout.kv_size
        desc = []
        for i, c in enumerate(job.copies):
            if slots is None:
                src = self._obj_dev[c.object_index] + c.src_token_start * row
                lstride = self._obj_tokens[c.object_index] * row
            else:
                src = kv * slots * row * self._first[i]
                lstride = c.num_tokens * row
            desc.append((src, lstride, c.dst_position, c.num_tokens, self._first[i]))
        if slots is None:
            vec = _vec_bytes(e.layout_vec, *{d[0] for d in desc}, *{d[1] for d in desc})
        else:
            vec = e.layout_vec
        table, slot = e.build_table(desc, job.block_ids[group], n_tok)
        self._leased.append(slot)
        hit = (table, vec)
        self._tables[key] = hit
        return hit

    # --- launches --------------------------------------------------------------------

    def _launch(self, scatter: bool, table: int, vec: int, n_tok: int, layer_offset: int,
                staged_layers: int, src_layers: int, src_layer0: int, src_base: int = 0) -> None:
        e, lay = self.engine, self.engine.layout
        e.ext.copy(scatter, e.planes.data_ptr(), table, src_base, n_tok, lay.kv_size, lay.num_layers,
                   layer_offset, staged_layers, src_layers, src_layer0, e.row_bytes, lay.head_bytes,
                   lay.head_stride, vec, e.max_ctas, e.index, e.stream.cuda_stream)

    def _group_runs(self, layer_start: int, layer_count: int) -> list[tuple[int, int, int]]:
        """(group, first layer, layers) runs of consecutive layers sharing a KV group inside the slice."""
        lay = self.engine.layout
        if not lay.is_hybrid:
            return [(0, layer_start, layer_count)]
        group = lay.group_of_layer()
        runs: list[tuple[int, int, int]] = []
        for layer in range(layer_start, layer_start + layer_count):
            g = group[layer]
            if runs and runs[-1][0] == g and runs[-1][1] + runs[-1][2] == layer:
                runs[-1] = (g, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((g, layer, 1))
        return runs

    def scatter(self, job: TransferJob, layer_start: int, layer_count: int) -> None:
        """Enqueue layers [layer_start, +layer_count) of every copy (0 = all layers) on the engine's stream."""
        lay = self.engine.layout
        if layer_count == 0:
            layer_start, layer_count = 0, lay.num_layers
        if not job.copies:
            return
        if self.engine.config.mode == "staged" and not lay.is_hybrid:
            self._scatter_staged(job, layer_start, layer_count)
            return
        n_tok = self._bind(job)
        for g, first, count in self._group_runs(layer_start, layer_count):
            table, vec = self._table(job, g, None)
            # The object is the staged side, read in place: all L layers per plane, slice at `first`.
            self._launch(True, table, vec, n_tok, first, count, lay.num_layers, first)

    def gather(self, job: TransferJob) -> None:
        """Enqueue reading every layer of every copy from the cache into the objects (STORE)."""
        if not job.copies:
            return
        lay = self.engine.layout
        if self.engine.config.mode == "staged" and not lay.is_hybrid:
            self._gather_staged(job)
            return
        n_tok = self._bind(job)
        for g, first, count in self._group_runs(0, lay.num_layers):
            table, vec = self._table(job, g, None)
            self._launch(False, table, vec, n_tok, first, count, lay.num_layers, first)

    def synchronize(self) -> None:
        self.engine.synchronize()

    # --- staged mode (copy engine) ---------------------------------------------------

    def _pieces(self, layer_start: int, layer_count: int, per_layer_bytes: int) -> list[tuple[int, int]]:
        cap = max(1, self.engine.config.staging_bytes // max(per_layer_bytes, 1))
        return [(s, min(cap, layer_start + layer_count - s)) for s in range(layer_start, layer_start + layer_count, cap)]

    def _object_runs(self, job: TransferJob, first: int, count: int, stage_base: int | None,
                     to_device: bool) -> list[tuple[int, int, int]]:
        """{dst, src, bytes} rows moving layers [first, +count) of every copy between host and staging.

        An object is ``[kv, layers, tokens, row]``: when a copy spans the whole object
        the slice is ``kv`` contiguous ranges, otherwise one range per layer.
        """
        lay, row = self.engine.layout, self.engine.row_bytes
        self._bind(job)
        rows: list[tuple[int, int, int]] = []
        kv = lay.kv_size
        for i, c in enumerate(job.copies):
            T = self._obj_tokens[c.object_index]
            host = self._obj_host[c.object_index]
            stage_copy = stage_base + kv * count * row * self._first[i]
            for k in range(lay.kv_size):
                if c.num_tokens == T:
                    h = host + (k * lay.num_layers + first) * T * row
                    s = stage_copy + k * count * T * row
                    rows.append((s, h, count * T * row) if to_device else (h, s, count * T * row))
                else:
                    for j in range(count):
                        h = host + ((k * lay.num_layers + first + j) * T + c.src_token_start) * row
                        s = stage_copy + (k * count + j) * c.num_tokens * row
                        n = c.num_tokens * row
                        rows.append((s, h, n) if to_device else (h, s, n))
        return rows

    def _piece_jobs(self, job: TransferJob, first: int, count: int, stage_base: int,
                    to_device: bool) -> tuple[int, int, Any]:
        """Copy-engine jobs for one piece, as (host address of the ``[n, 6]`` rows, n, what keeps them alive): the
        piece's template (:meth:`_dma_template`) moved to layer ``first`` and staging at ``stage_base``. The usual
        case, objects back to back, is one row of plain integers packed into the engine's row buffer (call under
        ``_stage_lock``): numpy's array set-up costs tens of microseconds on a cold path to the first copy."""
        jobs = self._piece_rows(job, first, count, stage_base, to_device)
        if isinstance(jobs, tuple):
            e = self.engine
            struct.pack_into("<6q", e._job_row, 0, *jobs)
            return e._job_row_addr, 1, None
        return jobs.ctypes.data, len(jobs), jobs

    def _piece_rows(self, job: TransferJob, first: int, count: int, stage_base: int,
                    to_device: bool) -> "tuple[int, int, int, int, int, int] | np.ndarray":
        """The ``dst, dpitch, src, spitch, width, height`` jobs of one piece: its template moved to layer ``first``
        on the host side and to ``stage_base`` on the staging side; one tuple where the template is one."""
        template, shift = self._dma_template(job, count, to_device)
        if isinstance(template, tuple):
            d, dp, src, sp, w, h = template
            return (d + stage_base, dp, src + first * shift, sp, w, h) if to_device else \
                (d + first * shift, dp, src + stage_base, sp, w, h)
        jobs = template.copy()
        host_col, stage_col = (2, 0) if to_device else (0, 2)
        jobs[:, host_col] += first * shift
        jobs[:, stage_col] += stage_base
        return jobs

    def _dma_template(self, job: TransferJob, count: int, to_device: bool) -> tuple[Any, Any]:
        """The copy-engine jobs of a piece of ``count`` layers at layer 0 with staging at 0, and how far each job's
        host side moves per layer (an int, or one per job): the piece at layer ``first`` is the template with
        ``first`` times that added on the host side. Planned once per transfer and piece size.

        When every copy is a whole object of one size and the objects sit back to back, the template is one packed
        2D job (a tuple); otherwise the jobs :func:`plan_dma` folds the piece's (object, plane) ranges into, folded
        per object size, since a layer moves an object of ``T`` tokens ``T`` rows further."""
        key = ("dma", count, to_device)
        hit = self._tables.get(key)
        if hit is not None:
            return hit
        self._bind(job)
        lay, row = self.engine.layout, self.engine.row_bytes
        if self._uniform:
            template: Any = self._back_to_back_template(job, count, to_device)
            if template is None:
                # rows of the piece at layer 0, in (copy, plane) order, computed at C speed
                T = self._uniform
                first_tok = np.asarray(self._first, dtype=np.int64)[:, None]
                host = np.asarray([self._obj_host[c.object_index] for c in job.copies], dtype=np.int64)[:, None]
                k = np.arange(lay.kv_size, dtype=np.int64)[None, :]
                stage = lay.kv_size * count * row * first_tok + k * count * T * row
                src = host + k * lay.num_layers * T * row
                rows = np.empty((stage.size, 3), dtype=np.int64)
                rows[:, 0], rows[:, 1] = (stage.reshape(-1), src.reshape(-1)) if to_device else \
                    (src.reshape(-1), stage.reshape(-1))
                rows[:, 2] = count * T * row
                template = plan_dma(rows)
            hit = (template, self._uniform * row)
        else:
            rows = np.asarray(self._object_runs(job, 0, count, 0, to_device), dtype=np.int64).reshape(-1, 3)
            sizes = [self._obj_tokens[c.object_index] for c in job.copies]
            per_row = np.repeat(np.asarray(sizes, dtype=np.int64) * row,
                                [lay.kv_size if c.num_tokens == T else lay.kv_size * count
                                 for c, T in zip(job.copies, sizes)])
            parts = [(plan_dma(rows[per_row == step]), step) for step in np.unique(per_row).tolist()]
            hit = (np.concatenate([jobs for jobs, _ in parts]),
                   np.concatenate([np.full(len(jobs), step, dtype=np.int64) for jobs, step in parts]))
        self._tables[key] = hit
        return hit

    def _back_to_back_template(self, job: TransferJob, count: int,
                               to_device: bool) -> tuple[int, int, int, int, int, int] | None:
        """The layer-0 piece as one 2D copy when the objects sit back to back in the pool (:func:`back_to_back_job`),
        else None."""
        return back_to_back_job(self.engine.layout, self.engine.row_bytes, self._uniform,
                                [self._obj_host[c.object_index] for c in job.copies], count, to_device)

    def _direct_runs(self, job: TransferJob, first: int, count: int) -> list[tuple[int, int, int]] | None:
        """Copy-engine rows straight into the engine's cache, or None if the runs would be too short."""
        e, lay, row = self.engine, self.engine.layout, self.engine.row_bytes
        if not e.dense_rows or self._bind(job) * row < e.config.direct_copy_min_run:
            # not even one run covering every token would be long enough: no need to work out the runs (a
            # Python loop over every block, on the way to the first slice)
            return None
        key = ("runs",)
        runs = self._tables.get(key)
        if runs is None:
            # Per copy: maximal token ranges whose blocks are consecutive (contiguous in the engine).
            spans: list[tuple[int, int, int, int]] = []  # (object, object token, engine offset, tokens)
            table = job.block_ids[0]
            bs = lay.block_size
            for c in job.copies:
                t = 0
                while t < c.num_tokens:
                    pos = c.dst_position + t
                    blk, off = table[pos // bs], pos % bs
                    n = min(bs - off, c.num_tokens - t)
                    eng = blk * lay.block_stride + off * lay.token_stride
                    if spans and spans[-1][0] == c.object_index and spans[-1][2] + spans[-1][3] * row == eng \
                            and spans[-1][1] + spans[-1][3] == c.src_token_start + t:
                        o, ot, en, nn = spans[-1]
                        spans[-1] = (o, ot, en, nn + n)
                    else:
                        spans.append((c.object_index, c.src_token_start + t, eng, n))
                    t += n
            runs = spans
            self._tables[key] = runs
        total = sum(s[3] for s in runs) * row
        if total // max(len(runs), 1) < e.config.direct_copy_min_run:
            return None
        out = []
        for layer in range(first, first + count):
            for k in range(lay.kv_size):
                plane = int(e._plane_addrs[layer * lay.kv_size + k])
                for o, ot, eng, n in runs:
                    T = self._obj_tokens[o]
                    out.append((plane + eng, self._obj_host[o] + ((k * lay.num_layers + layer) * T + ot) * row,
                                n * row))
        return out

    def _scatter_staged(self, job: TransferJob, layer_start: int, layer_count: int) -> None:
        e, lay = self.engine, self.engine.layout
        direct = self._direct_runs(job, layer_start, layer_count)
        if direct is not None:
            jobs = plan_dma(direct)
            e.ext.memcpy2d_runs(jobs.ctypes.data, len(jobs), e.index, e.stream.cuda_stream)
            return
        n_tok = self._bind(job)
        per_layer = lay.kv_size * n_tok * e.row_bytes
        kernel_s = e.stream.cuda_stream
        deferred = isinstance(e.ext, LoadIssuer)  # ops reach the GPU when handed over, not as they are made
        # a buffer whose copy (after its wait for the buffer) is on its way to the GPU while the rest of its piece
        # is not: should planning fail, the buffer is marked idle after that copy (abandon_staging)
        handed = None
        with e._stage_lock:
            try:
                for first, count in self._pieces(layer_start, layer_count, per_layer):
                    staged = self._take_staged(job, first, count, per_layer)
                    if staged is not None:  # its copy is on the copy stream already, followed by its buffer's fill
                        b, stage = staged.buffer, staged.stage
                        handed = b
                    else:
                        b = e._piece % len(e._used)
                        e._piece += 1
                        stage = e.staging(b, per_layer * count).data_ptr()
                        rows, n_rows, _keep = self._piece_jobs(job, first, count, stage, to_device=True)
                        # host -> staging, issued before the token table is built, so the first bytes move at once
                        e.copy_into_staging(b, rows, n_rows)
                        if not deferred:
                            handed = b
                        elif first == layer_start:
                            e.copy_planned()
                            handed = b
                    table, vec = self._table(job, 0, count)
                    # kernel stream: staging -> engine layout, overlapping the next piece's copy
                    e.ext.stream_wait_event(kernel_s, e._filled_h[b])
                    self._launch(True, table, vec, n_tok, first, count, count, 0, src_base=stage)
                    e.ext.event_record(e._idle_h[b], kernel_s)
                    if not deferred:
                        handed = None  # the piece is on the GPU whole
            except BaseException:
                if handed is not None:
                    e.abandon_staging(handed)
                raise

    def _take_staged(self, job: TransferJob, first: int, count: int, per_layer: int) -> "StagedFirstLayer | None":
        """The staged first layer, if this piece is that layer and its copy is the one this piece would issue
        (checked job for job, so a staged copy is used only for what it moved); else None (the copier gives its
        buffer back when it closes)."""
        staged, self.staged_first = self.staged_first, None
        if staged is None or not staged.usable_here() or first != 0 or count != 1 or staged.nbytes != per_layer:
            return None
        rows = self._piece_rows(job, 0, 1, staged.stage, to_device=True)
        if not isinstance(rows, tuple) or rows != staged.job:
            return None
        staged.taken = True
        return staged

    def scatter_slices(self, job: TransferJob, slices: Sequence[tuple[int, int]],
                       events: Sequence[int]) -> list[list[int]]:
        """Inside a :class:`~kvstrata.native.load_issuer.LoadIssuer` program: enqueue each ``(layer_start,
        layer_count)`` slice, each followed by a record of its event (a raw handle) and a mark; returns the marks'
        cells (see :class:`~kvstrata.native.load_issuer.IssuedSlice`).

        In staged mode the ops :meth:`scatter` would record slice by slice are written natively into one part of
        the program (the extension's ``write_staged_slices``, ``native/csrc/staged_slices.h``): the host works
        out each piece size's token table and copy-engine jobs once, and the load's slice count costs it nothing
        more. Elsewhere (kernel mode, hybrid layouts, direct copies) slice by slice."""
        e, lay, issuer = self.engine, self.engine.layout, self.engine.ext
        kernel_s = e.stream.cuda_stream
        if (e.config.mode != "staged" or lay.is_hybrid or not job.copies
                or self._direct_runs(job, *slices[0]) is not None):
            cells = []
            for (start, count), event in zip(slices, events):
                self.scatter(job, start, count)
                issuer.event_record(event, kernel_s)
                cells.append(issuer.mark())
            return cells
        n_tok = self._bind(job)
        per_layer = lay.kv_size * n_tok * e.row_bytes
        cap = max(1, e.config.staging_bytes // max(per_layer, 1))
        slice_counts = set(map(operator.itemgetter(1), slices))  # at C speed: a load may have 80 slices
        counts = sorted({n for count in slice_counts for n in (min(count, cap), count % cap if count > cap else 0)
                         if n})
        tables = [self._table(job, 0, count) for count in counts]  # recorded before the scatters read them
        kinds, job_rows = [], []
        for count, (table, vec) in zip(counts, tables):
            template, shift = self._dma_template(job, count, to_device=True)
            rows = np.empty((1 if isinstance(template, tuple) else len(template), 7), dtype=np.int64)
            rows[:, :6], rows[:, 6] = template, shift
            kinds.append((count, table, vec, sum(len(r) for r in job_rows), len(rows)))
            job_rows.append(rows)
        slice_words = np.column_stack((np.asarray(slices, dtype=np.int64).reshape(-1, 2),
                                       np.asarray(events, dtype=np.int64)))
        longest = max(len(r) for r in job_rows)
        pieces = len(slices) * -(-max(slice_counts) // cap)  # at most
        out = np.empty(pieces * (40 + 6 * longest) + 7 * len(slices), dtype=np.int64)
        marks_at = np.empty(len(slices), dtype=np.int64)
        kinds_words, jobs_words = np.asarray(kinds, dtype=np.int64), np.concatenate(job_rows)
        launch = np.asarray((e.copy_stream.cuda_stream, e.stream.cuda_stream, e.planes.data_ptr(), n_tok,
                             lay.kv_size, lay.num_layers, e.row_bytes, lay.head_bytes, lay.head_stride,
                             e.max_ctas, e.index), dtype=np.int64)
        with e._stage_lock:
            n_buffers = len(e._used)
            buffers = np.asarray([(e.staging(b, per_layer * counts[-1]).data_ptr(), e._filled_h[b],
                                   e._idle_h[b], e._used[b]) for b in range(n_buffers)], dtype=np.int64)
            try:
                words, written = issuer.write_staged_slices(
                    slice_words.ctypes.data, len(slices), cap, kinds_words.ctypes.data, len(kinds),
                    jobs_words.ctypes.data, buffers.ctypes.data, n_buffers, e._piece % n_buffers,
                    launch.ctypes.data, out.ctypes.data, len(out), marks_at.ctypes.data)
            except BaseException:
                e._used = [True] * n_buffers  # some may be marked: waiting for an idle buffer costs nothing
                raise
            e._piece += written
            e._used = [bool(used) for used in buffers[:, 3]]
            return issuer.record_ops(out[:words], marks_at.tolist())

    def _gather_staged(self, job: TransferJob) -> None:
        """Engine -> staging (kernel stream) -> pinned L1 (copy stream), double-buffered across calls.

        Completion is the engine's synchronize(), which covers both streams.
        """
        e, lay = self.engine, self.engine.layout
        n_tok = self._bind(job)
        per_layer = lay.kv_size * n_tok * e.row_bytes
        copy_s, kernel_s = e.copy_stream.cuda_stream, e.stream.cuda_stream
        with e._stage_lock:
            for first, count in self._pieces(0, lay.num_layers, per_layer):
                b = e._piece % len(e._used)
                e._piece += 1
                stage = e.staging(b, per_layer * count).data_ptr()
                table, vec = self._table(job, 0, count)
                rows, n_rows, _keep = self._piece_jobs(job, first, count, stage, to_device=False)
                if e._used[b]:
                    e.ext.stream_wait_event(kernel_s, e._idle_h[b])
                self._launch(False, table, vec, n_tok, first, count, count, 0, src_base=stage)
                e.ext.event_record(e._filled_h[b], kernel_s)
                e.ext.stream_wait_event(copy_s, e._filled_h[b])
                e.ext.memcpy2d_runs(rows, n_rows, e.index, copy_s)
                e.ext.event_record(e._idle_h[b], copy_s)
                e._used[b] = True


class TorchCudaExecutor:
    """The pure-torch reference on GPU tensors: correct everywhere torch runs, not fast.

    Used when the CUDA extension cannot be built (the server then reports the
    native path unavailable, so layer-major requests run chunk-major) and as the
    GPU oracle in tests.
    """

    name = "torch-cuda"

    def __init__(self, engine: CudaTransferEngine, objects: Sequence[torch.Tensor]) -> None:
        _check_objects(engine.layout, objects)
        self.engine = engine
        self.objects = list(objects)

    def _slots(self, job: TransferJob, index: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        pairs = [job.slots(index, g) for g in range(len(job.layout.groups))]
        dev = self.engine.device
        return [p[0].to(dev) for p in pairs], [p[1].to(dev) for p in pairs]

    def scatter(self, job: TransferJob, layer_start: int, layer_count: int) -> None:
        from kvstrata.core.transfer.torch_executor import scatter_staged

        e = self.engine
        with torch.cuda.device(e.index), torch.cuda.stream(e.stream):
            for i, c in enumerate(job.copies):
                obj = self.objects[c.object_index]
                tokens = slice(c.src_token_start, c.src_token_start + c.num_tokens)
                layers = slice(None) if layer_count == 0 else slice(layer_start, layer_start + layer_count)
                staged = obj[:, layers, tokens].to(e.device)
                blocks, offsets = self._slots(job, i)
                scatter_staged(staged, e.regions, job.layout, blocks, offsets,
                               layer_offset=layer_start if layer_count else 0, staged_layers=layer_count)

    def gather(self, job: TransferJob) -> None:
        from kvstrata.core.transfer.torch_executor import gather_staged

        e = self.engine
        with torch.cuda.device(e.index), torch.cuda.stream(e.stream):
            for i, c in enumerate(job.copies):
                obj = self.objects[c.object_index]
                tokens = slice(c.src_token_start, c.src_token_start + c.num_tokens)
                out = torch.empty(job.layout.object_shape(c.num_tokens), dtype=torch.uint8, device=e.device)
                blocks, offsets = self._slots(job, i)
                gather_staged(out, e.regions, job.layout, blocks, offsets)
                obj[:, :, tokens].copy_(out.cpu())

    def close(self) -> None:
        return None  # torch's allocator tracks its temporaries itself

    def synchronize(self) -> None:
        self.engine.synchronize()


class StagedFirstLayer:
    """Layer 0 of a load whose copy into a staging buffer went to the GPU at submit, before the load was planned.

    Planning a load (its copies, its token table, its executor) takes the engine's thread a few hundred
    microseconds; layer 0's copy needs only where the objects lie. So :meth:`CudaLocalCopier.stage_first_layer`
    hands that one copy to the native thread first, and the load's plan then scatters from this buffer
    (:meth:`CudaExecutor._take_staged`). Until :meth:`close` it holds the copier's program (the native thread
    issues what follows in order) and its staging lock, so that no other piece can take this buffer before its
    scatter is planned.
    """

    def __init__(self, copier: "CudaLocalCopier", stack: contextlib.ExitStack, buffer: int, stage: int, nbytes: int,
                 job: tuple[int, int, int, int, int, int]) -> None:
        self._copier = copier
        self._stack = stack
        self.buffer = buffer
        self.stage = stage
        """The staging buffer's device address."""
        self.nbytes = nbytes
        self.job = job
        """The ``dst, dpitch, src, spitch, width, height`` copy it issued."""
        self.taken = False
        """A load's plan scattered from it."""
        self.closed = False
        self._owner = threading.get_ident()
        """The thread that staged it: the copier's program and staging lock it holds are that thread's."""

    def usable_here(self) -> bool:
        """Whether a plan on the calling thread may scatter from it: still held, by this thread."""
        return not self.closed and threading.get_ident() == self._owner

    def close(self, planned: bool) -> None:
        """End the hold: ``planned``, the load's first layer was planned in full since (from this buffer, or, where
        its plan differed, from another); otherwise what was recorded since the copy is dropped. Either way a
        buffer no scatter reads is idle once its copy has ran. Hands what was planned to the native thread. A
        no-op on any thread but the one that staged it, which closes it when its submit ends."""
        if not self.usable_here():
            return
        self.closed = True
        issuer, engine = self._copier.issuer, self._copier.engine
        try:
            if not planned:
                issuer.discard()
            if not (planned and self.taken):
                issuer.event_record(engine._idle_h[self.buffer], engine.copy_stream.cuda_stream)
        finally:
            self._stack.close()


class CudaLocalCopier:
    """Engine-placement loads: this engine process copies from the server's L1 pool into its own CUDA cache.

    Built once per mapping of the pool (at registration): the pool, mapped read-only here, is registered for
    DMA from then on, in the background where the copies read it through the copy engine only
    (:class:`~kvstrata.native.host_pinning.PoolPinning`; ``register_s`` is what the engine's start waited), and
    the copies run on this process's own streams in the
    engine's CUDA context, so they are not time-sliced against the engine's compute the way a server
    process's kernels are. The transfer queue plans each slice inside :meth:`slice_program`; the slice's GPU
    work, its event's record included, then reaches the GPU through this copier's native
    :class:`~kvstrata.native.load_issuer.LoadIssuer` thread, and a layer wait makes the engine's stream wait on
    that event: neither the CPU nor any Python thread waits for a copy.

    The streams run at normal priority (:data:`ENGINE_COPY_PRIORITY`): the highest measured no better with the
    engine computing. The copies take turns on two staging buffers (``CudaTransferConfig.staging_buffers``); more
    measured no better either.

    Under compute, one copier of a process can load slower than another of identical settings: its copy
    engine's host-to-staging time, decided by the order of the copiers' first transfers. Neither its streams
    (two copy streams a piece change nothing), its staging buffers and token table (allocated at registration),
    nor the pool's mapping or host page size decide it; copies alone are not slowed by the compute
    (``benchmarks/copy_under_compute.py``). What decides it is not known, so an A/B of copier settings puts
    each setting at an odd and an even position (``benchmarks/README.md``).
    """

    def __init__(self, layout: PagedKVLayout, regions: Sequence[torch.Tensor], pool: torch.Tensor,
                 device_index: int, config: CudaTransferConfig | None = None, *, writable: bool = False) -> None:
        """``writable``: the pool is mapped writable here and registered so, for engine-placement stores.

        By default the copy engine always goes through staging buffers here, with the scatter kernel in the
        engine's context, also where the layout would let it write the cache directly (SGLang's per-layer
        buffers): in the engine's process the direct copies were slower, in the load and in first-token time
        (``benchmarks/ttft_direct_copy_ab.sh``; its figures are in ``benchmarks/README.md``)."""
        t0 = time.perf_counter()
        config = config or CudaTransferConfig(direct_copy_min_run=NO_DIRECT_COPIES, stream_priority=ENGINE_COPY_PRIORITY)
        self.pool = pool
        self.engine = CudaTransferEngine(layout, regions, pool, device_index, config, pool_read_only=not writable,
                                         pin_in_background=True)
        self.issuer: LoadIssuer | None = None
        """Issues what the executors plan (None in torch mode, whose torch calls run as they are made)."""
        self._spare_events: list[torch.cuda.Event] = []
        """Slice events no slice refers to any more (:class:`IssuedSlice` gives its event back when dropped)."""
        if self.engine.ext is not None:
            self.issuer = LoadIssuer(self.engine.ext, device_index)
            self.engine.ext = self.issuer
            self.engine.before_buffer_change = self.issuer.flush
            self.engine.copy_planned = self.issuer.hand_over
        self.register_s = time.perf_counter() - t0
        pinning = self.engine.pinning
        log.info("engine-placement %s on cuda:%d: ready in %.3f s; %d MiB L1 pool%s %s",
                 "loads and stores" if writable else "loads", device_index, self.register_s, pool.numel() >> 20,
                 "" if writable else " (read-only)",
                 "registering for DMA in the background (copies read what is not yet registered as pageable "
                 "memory)" if pinning is not None and pinning.background else "registered for DMA")

    def executor(self, spans: Sequence[tuple[int, int]]) -> "CudaExecutor | TorchCudaExecutor":
        if self.engine.pool is None:  # torch mode: tensor views (the pool is not pinned by the extension there)
            signature = self.engine.layout.shape_signature()
            return self.engine.executor([span_view(self.pool, signature, off, tokens) for off, tokens in spans])
        return self.engine.pool_executor(spans)

    def stage_first_layer(self, spans: Sequence[tuple[int, int]]) -> StagedFirstLayer | None:
        """Hand layer 0's copy of the objects at ``spans`` ((offset in the pool, tokens), in the load's order)
        into a staging buffer to the native thread now, before the load is planned; None where the load's plan
        would not copy it so: objects of unequal size or not back to back (a partial last chunk), other modes.

        The caller plans the load before it calls :meth:`StagedFirstLayer.close`, on this thread: the copier's
        staging and program stay held until then."""
        e = self.engine
        if (self.issuer is None or e.pool is None or e.config.mode != "staged" or e.layout.is_hybrid
                or e.config.direct_copy_min_run < NO_DIRECT_COPIES or not spans):
            return None
        lay, row = e.layout, e.row_bytes
        tokens = spans[0][1]
        base, size, _ = e._pool_range
        if any(t != tokens for _, t in spans) or not 0 <= spans[0][0] <= size - lay.object_bytes(tokens) * len(spans):
            return None
        template = back_to_back_job(lay, row, tokens, [base + off for off, _ in spans], 1, to_device=True)
        if template is None:
            return None
        per_layer = lay.kv_size * len(spans) * tokens * row  # a first piece is one layer, whatever the buffers' cap
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(self.issuer.program())
            stack.enter_context(e._stage_lock)
            b = e._piece % len(e._used)
            e._piece += 1
            stage = e.staging(b, per_layer).data_ptr()
            job = (stage, *template[1:])
            struct.pack_into("<6q", e._job_row, 0, *job)
            e.copy_into_staging(b, e._job_row_addr, 1)
            self.issuer.hand_over()
        except BaseException:
            self.issuer.discard()
            stack.close()
            raise
        return StagedFirstLayer(self, stack, b, stage, per_layer, job)

    def slice_program(self) -> ContextManager[Any]:
        """Plan one slice inside this: on exit its GPU work goes to the native thread in one call."""
        return self.issuer.program() if self.issuer is not None else contextlib.nullcontext()

    def mark_slice(self, executor: Any) -> "IssuedSlice | torch.cuda.Event":
        e = self.engine
        if self.issuer is None:
            with torch.cuda.device(e.index):
                event = torch.cuda.Event()
                event.record(e.stream)
            return event
        event = self._slice_event()  # its handle exists; the program records it after the slice's copies
        with self.issuer.program():  # the slice's own program (joined), or one of its own if called outside
            self.issuer.event_record(event.cuda_event, e.stream.cuda_stream)
            return IssuedSlice(self.issuer, self.issuer.mark(), event, self._spare_events.append)

    def enqueue_slices(self, executor: Any, job: TransferJob,
                       slices: Sequence[tuple[int, int]]) -> "list[IssuedSlice | torch.cuda.Event]":
        """Plan ``slices`` of a load and hand them to the native thread as one program (see
        :meth:`CudaExecutor.scatter_slices`); each slice's completion, in order."""
        if self.issuer is None:  # torch mode: the copies are enqueued as they are planned
            completions = []
            for start, count in slices:
                executor.scatter(job, start, count)
                completions.append(self.mark_slice(executor))
            return completions
        events = [self._slice_event() for _ in slices]
        with self.issuer.program():
            cells = executor.scatter_slices(job, slices, [event.cuda_event for event in events])
        recycle = self._spare_events.append
        return [IssuedSlice(self.issuer, cell, event, recycle) for cell, event in zip(cells, events)]

    def _slice_event(self) -> torch.cuda.Event:
        """An event for a slice: one a finished slice gave back, else a new one. Creating one through torch (its
        handle exists only once recorded) costs microseconds, once per slice of every load otherwise."""
        try:
            return self._spare_events.pop()
        except IndexError:
            return self.engine._event()

    def finish(self, last_completion: "IssuedSlice | torch.cuda.Event | None") -> None:
        if last_completion is not None:
            last_completion.synchronize()  # without the GIL while it waits

    @contextlib.contextmanager
    def _issued(self) -> Any:
        """Plan inside this; on exit, returns once the plan is on the streams (torch calls may follow it)."""
        if self.issuer is None:
            yield
            return
        with self.issuer.program():
            yield
            cell = self.issuer.mark()
        self.issuer.wait_issued(cell[0])

    def gather(self, spans: Sequence[tuple[int, int, int]], block_ids: Sequence[Sequence[int]]) -> torch.cuda.Event:
        e = self.engine
        with torch.cuda.device(e.index):
            queued = torch.cuda.Event()
            queued.record(torch.cuda.current_stream(e.index))  # the forward that wrote these blocks
            e.stream.wait_event(queued)  # this process's streams wait on the GPU; the engine's does not
            if e.copy_stream is not None:
                e.copy_stream.wait_event(queued)
            try:
                # one job over every reserved object: one token table and one copy-engine job per piece of
                # layers (the objects are normally back to back in the pool), not a table per object
                job = TransferJob(e.layout, block_ids, [ChunkCopy(i, 0, tokens, position)
                                                        for i, (_, tokens, position) in enumerate(spans)])
                executor = self.executor([(offset, tokens) for offset, tokens, _ in spans])
                try:
                    with self._issued():
                        executor.gather(job)
                finally:
                    close = getattr(executor, "close", None)
                    if close is not None:
                        close()
            except BaseException:
                self._synchronize()  # nothing enqueued may still write into objects about to be dropped
                raise
            if e.copy_stream is not None:
                copied = torch.cuda.Event()
                copied.record(e.copy_stream)
                e.stream.wait_event(copied)
            done = torch.cuda.Event()
            done.record(e.stream)
        return done

    def _synchronize(self) -> None:
        """Block until everything planned so far has been issued and has run."""
        if self.issuer is not None:
            with self._issued():
                pass
        self.engine.synchronize()

    def close(self) -> None:
        if self.issuer is not None:
            self.issuer.close()  # issues what is queued first: the engine then waits for it to run
        self.engine.close()
