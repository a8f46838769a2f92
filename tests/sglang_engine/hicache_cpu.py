"""Test-only: what SGLang 0.5.23's HiCache needs replaced to run on a CPU machine (no CUDA, no sgl_kernel).

HiCache's host pool and its host<->device copies are written for CUDA/HIP/XPU. On CPU these calls fail,
and nothing of kvstrata's is involved in any of them; the tests replace them openly, in every process of the
engine (``sitecustomize.py`` calls :func:`install` when ``KVSTRATA_TEST_SGLANG_HICACHE_CPU`` is set):

* ``pool_host/common.py``'s ``_cuda_host_register``: pins the host pool with ``cudaHostRegister`` (there is
  no CUDA runtime): replaced by nothing (pinning only matters for DMA to a GPU);
* ``torch.cpu.Stream.synchronize``, which SGLang's cache controller calls and torch's CPU stream does not
  have: replaced by nothing (CPU work is done when its call returns);
* the host<->device copy ops ``pool_host/mha.py`` binds only on CUDA/HIP/XPU (from ``sgl_kernel.kvcacheio``):
  ``transfer_kv_direct`` (``layer_first`` + ``--hicache-io-backend direct``) and
  ``transfer_kv_per_layer_direct_pf_lf`` / ``transfer_kv_all_layer_direct_lf_pf`` (``page_first_direct`` +
  ``direct``), replaced by plain torch indexing with the same arguments and meaning. (``page_first`` needs the
  ``kernel`` IO backend, whose ops take device pointer tables: not replaced, so not run on CPU.)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

log = logging.getLogger("kvstrata.tests.hicache_cpu")


def transfer_kv_direct(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """Per layer tensor pair: ``dst[dst_indices] = src[src_indices]`` (token rows)."""
    src_i, dst_i = src_indices.to(torch.int64), dst_indices.to(torch.int64)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_i] = src[src_i]


def _page_rows(buffer: torch.Tensor, layer: int, indices: torch.Tensor, page_size: int) -> tuple:
    idx = indices.to(torch.int64)
    return buffer, (idx // page_size, layer, idx % page_size)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: Sequence[torch.Tensor], dst_ptrs: Sequence[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor, layer_id: int,
                                       page_size: int) -> None:
    """Host ``page_first_direct`` ``[pages, layers, page, heads, dim]`` -> one device layer ``[slots, heads, dim]``."""
    dst_i = dst_indices.to(torch.int64)
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        buf, where = _page_rows(src, layer_id, src_indices, page_size)
        dst[dst_i] = buf[where]


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: Sequence[torch.Tensor], dst_ptrs: Sequence[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """Every device layer (K layers, then V layers) -> host ``page_first_direct`` K and V."""
    src_i = src_indices.to(torch.int64)
    k_host, v_host = dst_ptrs
    layers = len(src_ptrs) // 2
    for plane, host in ((0, k_host), (1, v_host)):
        for layer in range(layers):
            buf, where = _page_rows(host, layer, dst_indices, page_size)
            buf[where] = src_ptrs[plane * layers + layer][src_i]


def install() -> None:
    from sglang.srt.mem_cache.pool_host import common, mha

    def no_host_register(buffer: torch.Tensor, registration_granularity_bytes: int | None = None) -> None:
        return None  # CPU only: nothing to pin for

    common._cuda_host_register = no_host_register
    torch.cpu.Stream.synchronize = lambda self: None
    mha.transfer_kv_direct = transfer_kv_direct
    mha.transfer_kv_per_layer_direct_pf_lf = transfer_kv_per_layer_direct_pf_lf
    mha.transfer_kv_all_layer_direct_lf_pf = transfer_kv_all_layer_direct_lf_pf
    log.warning("test-only HiCache CPU replacements installed (tests/sglang_engine/hicache_cpu.py)")
