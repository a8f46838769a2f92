"""Keeping a GPU target's host path to the first slice warm between transfers.

A retrieve's first slice costs the server about 0.2 ms of host work when it
follows another transfer at once, and twice that after 20 ms of anything else,
spinning included (``benchmarks/profile_host.py --idle-study``,
``results/idle-study-h200.txt``): the planner's, executor's and driver's code and
data have left the core's caches by then. Running the same code on a scratch
transfer every millisecond of the server's busy-poll window keeps them there; in
the same study a first slice after such rehearsals took 0.23 ms against 0.40 ms
(``results/idle-study-rehearsal-h200.txt``).

Off by default (``--keep-warm-ms``): end to end on the H200 it lowered a width-1
release once (0.80 against 0.91 ms) but made the wider layer-major transfers in
flight finish later, since a rehearsal holds the GIL when such a transfer's
thread needs it (``results/h200-2026-12-01-runs/``, runs 19 and 20).

The rehearsal is a real transfer through the very functions a retrieve calls
(plan, executor over pinned pool addresses, a one-layer slice with its token
table and kernel), but between memory the target owns: one block-sized L1 object
in a small pageable buffer it pins, and a scratch cache of one block with the
engine's strides, every layer plane aliasing the same bytes (what lands there is
never read). It never touches the engine's cache, the L1 store or their locks,
and it runs on the scratch engine's own streams.
"""

from __future__ import annotations

import logging
import threading

import torch

from kvstrata.core import planner
from kvstrata.core.layouts import PagedKVLayout, Region

from .cuda_executor import CudaTransferConfig, CudaTransferEngine

log = logging.getLogger(__name__)

_ALIGN = 4096


def scratch_layout(layout: PagedKVLayout) -> PagedKVLayout:
    """``layout``'s strides and shapes over one block in one small region, every (layer, plane) at offset 0.

    The same strides give the same code path (vector width, direct or staged
    copies, groups); aliasing the planes keeps the region at one block's span.
    """
    span = ((layout.block_size - 1) * layout.token_stride + (layout.num_heads - 1) * layout.head_stride
            + layout.head_bytes)
    return PagedKVLayout(
        format=layout.format, num_layers=layout.num_layers, kv_size=layout.kv_size, num_blocks=1,
        block_size=layout.block_size, num_heads=layout.num_heads, head_bytes=layout.head_bytes, dtype=layout.dtype,
        offsets=tuple(tuple((0, 0) for _ in range(layout.kv_size)) for _ in range(layout.num_layers)),
        block_stride=layout.block_stride, token_stride=layout.token_stride, head_stride=layout.head_stride,
        regions=(Region("local", span),), layer_groups=layout.layer_groups,
    )


class WarmPath:
    """A one-block scratch transfer on ``device_index``, run by :meth:`rehearse` while the server idles."""

    def __init__(self, layout: PagedKVLayout, device_index: int, config: CudaTransferConfig) -> None:
        self.layout = scratch_layout(layout)
        self.tokens = layout.block_size
        nbytes = self.layout.object_bytes(self.tokens)
        region = torch.zeros(self.layout.regions[0].size, dtype=torch.uint8, device=f"cuda:{device_index}")
        # pageable and page-aligned: the engine pins it (cudaHostRegister) as it pins the L1 pool
        raw = torch.zeros(nbytes + _ALIGN, dtype=torch.uint8)
        start = -raw.data_ptr() % _ALIGN
        self._raw = raw
        self.pool = raw[start:start + nbytes]
        self.engine = CudaTransferEngine(self.layout, [region], self.pool, device_index,
                                         CudaTransferConfig(mode=config.mode, max_ctas=config.max_ctas,
                                                            staging_bytes=config.staging_bytes))
        self._block_ids = [[0] for _ in self.layout.groups]
        self._lock = threading.Lock()  # a rehearsal and close() (another thread unregistering) exclude each other
        self._closed = False
        self.rehearsals = 0

    def rehearse(self) -> None:
        """One first slice of a one-object retrieve, as the server's retrieve path issues it."""
        with self._lock:
            if self._closed:
                return
            copies = planner.plan_copies([self.tokens], self.tokens, 0, 0)
            job = planner.TransferJob(self.layout, self._block_ids, copies)
            executor = self.engine.pool_executor([(0, self.tokens)])
            try:
                executor.scatter(job, 0, 1)
            finally:
                executor.close()
            self.rehearsals += 1

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.engine.close()
