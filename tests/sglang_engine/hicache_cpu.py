"""Test-only: what SGLang 0.5.23's HiCache needs replaced to run on a CPU machine (no CUDA, no sgl_kernel), and
the one host-memory reserve that would make the tests depend on what other processes use.

HiCache's host pool and its host<->device copies are written for CUDA/HIP/XPU. On CPU these calls fail,
and nothing of kvstrata's is involved in any of them; the tests replace them openly, in every process of the
engine (``sitecustomize.py`` calls :func:`install` when ``KVSTRATA_TEST_SGLANG_HICACHE_CPU`` is set):

* ``pool_host/common.py``'s ``_cuda_host_register``: pins the host pool with ``cudaHostRegister`` (there is
  no CUDA runtime): replaced by nothing (pinning only matters for DMA to a GPU);
* ``torch.cpu.Stream.synchronize``, which SGLang's cache controller calls and torch's CPU stream does not
  have: replaced by nothing (CPU work is done when its call returns);
* the host<->device copy ops ``pool_host/mha.py`` binds only on CUDA/HIP/XPU (from ``sgl_kernel.kvcacheio``):
  ``transfer_kv_direct`` (``layer_first`` + ``--hicache-io-backend direct``),
  ``transfer_kv_per_layer_direct_pf_lf`` / ``transfer_kv_all_layer_direct_lf_pf`` (``page_first_direct`` +
  ``direct``), and ``transfer_kv_per_layer_pf_lf`` / ``transfer_kv_all_layer_lf_pf`` (``page_first`` +
  ``kernel``: SGLang turns ``page_first`` + ``direct`` into ``page_first_direct``, so ``page_first`` runs only
  with the ``kernel`` backend; off CUDA its JIT variants are off, so ``MHATokenToKVPoolHost`` calls exactly
  these two), replaced by plain torch indexing with the same arguments and meaning.

One setting is not CPU-only: ``pool_host/base.py``'s ``HICACHE_HOST_MEMORY_RESERVE_BYTES``. SGLang refuses
a host pool unless 10 GiB of the machine's available memory stays free besides it (room for the OS and other
processes of a serving host). The tests' host pool is 128 MiB (``hicache_ratio`` 2 of the runner's fixed
16384-token device pool), on a 24 GiB machine shared with other processes: with the reserve, whether the engine
starts would depend on how much memory those use. :func:`install` sets it to 0, so the check that remains is
SGLang's own: the pool must fit in the memory available.

The two ``kernel`` ops are byte copies defined in sgl-kernel's ``csrc/kvcacheio/transfer.cu``
(``transfer_kv_launcher`` / ``transfer_kernel_impl`` with ``get_global_offset_pf``, ``_lf`` and
``_lf_tbl``): item ``i`` copies ``item_size`` bytes from source row ``src_indices[i]`` to destination row
``dst_indices[i]``, skipping a negative index; a ``page_first`` host tensor's row ``r``, layer ``l`` lies at
``base + r * layout_dim + l * item_size``, a device layer's row ``r`` at ``base + r * item_size``.
``transfer_kv_all_layer_lf_pf`` takes the device layers as a table of their addresses
(``buffers.k_data_ptrs``, ``torch.tensor([t.data_ptr() for t in layers])``): a table is resolved to the very
tensors SGLang built it from, which :func:`install` records when the host pool is constructed (the pool holds
both, ``device_k_data_ptrs`` and ``device_k_buffers``), and it is checked, at each call, to still hold their
addresses. Both check everything they rely on before copying and raise otherwise (:class:`Unhandled`), so a
call they do not handle copies nothing.
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


class Unhandled(RuntimeError):
    """A replaced op was called with arguments its test-only replacement does not handle."""


def _check(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise Unhandled(f"test-only CPU {op} (tests/sglang_engine/hicache_cpu.py) does not handle this call: {what}")


_calls: dict[str, int] = {}


def _called(op: str) -> None:
    _calls[op] = _calls.get(op, 0) + 1
    if _calls[op] == 1:  # the engine tests read this line to know which copies ran
        log.warning("test-only CPU replacement %s called", op)


def _items(op: str, src_indices: torch.Tensor, dst_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's items: int64 indices of one length (its TORCH_CHECKs), negative ones skipped (its loop)."""
    _check(src_indices.dtype == torch.int64 and dst_indices.dtype == torch.int64, op,
           f"indices {src_indices.dtype}, {dst_indices.dtype} (the kernel takes int64)")
    _check(src_indices.dim() == 1 and src_indices.shape == dst_indices.shape, op,
           f"index shapes {tuple(src_indices.shape)}, {tuple(dst_indices.shape)}")
    _check(src_indices.device.type == "cpu" and dst_indices.device.type == "cpu", op, "indices off the CPU")
    keep = (src_indices >= 0) & (dst_indices >= 0)
    return src_indices[keep], dst_indices[keep]


def _rows(op: str, t: torch.Tensor, row_bytes: int, what: str) -> torch.Tensor:
    """``t``'s bytes as ``[rows, row_bytes]``: the kernel addresses row ``r`` at ``base + r * row_bytes``,
    which is ``t``'s row ``r`` only if ``t`` is packed (contiguous) with rows of exactly that size."""
    _check(t.device.type == "cpu", op, f"{what} on {t.device}")
    _check(t.is_contiguous(), op, f"{what} is not contiguous (strides {t.stride()})")
    _check(t.dim() >= 1 and t[0].numel() * t.element_size() == row_bytes, op,
           f"{what} {tuple(t.shape)} {t.dtype} has rows of {t[0].numel() * t.element_size() if t.dim() else 0} "
           f"bytes, the call says {row_bytes}")
    return t.view(-1).view(torch.uint8).view(t.shape[0], row_bytes)


def _page_first(op: str, t: torch.Tensor, item_size: int, layout_dim: int, what: str) -> torch.Tensor:
    """A ``page_first`` host tensor ``[tokens, layers, heads, dim]`` as bytes ``[tokens, layers, item_size]``."""
    _check(item_size > 0 and item_size % 8 == 0, op, f"item_size {item_size} (the kernel needs a multiple of 8)")
    _check(layout_dim % item_size == 0, op, f"layout_dim {layout_dim} is not whole items of {item_size}")
    return _rows(op, t, layout_dim, what).view(t.shape[0], layout_dim // item_size, item_size)


def transfer_kv_per_layer_pf_lf(src_k: torch.Tensor, dst_k: torch.Tensor, src_v: torch.Tensor,
                                dst_v: torch.Tensor, src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                layer_id: int, item_size: int, src_layout_dim: int, block_quota: int = 2,
                                num_warps_per_block: int = 32) -> None:
    """Host ``page_first`` K and V ``[tokens, layers, heads, dim]`` -> one device layer ``[slots, heads, dim]``:
    ``dst[dst_indices[i]] = src[src_indices[i], layer_id]`` for K and V (load, ``load_to_device_per_layer``).
    ``block_quota`` / ``num_warps_per_block`` only shape the CUDA launch."""
    op = "transfer_kv_per_layer_pf_lf"
    src_i, dst_i = _items(op, src_indices, dst_indices)
    pairs = [(_page_first(op, src, item_size, src_layout_dim, f"host {kv}"),
              _rows(op, dst, item_size, f"device {kv}")) for kv, src, dst in (("K", src_k, dst_k), ("V", src_v, dst_v))]
    _check(0 <= layer_id < pairs[0][0].shape[1], op, f"layer {layer_id} of {pairs[0][0].shape[1]}")
    _called(op)
    for host, device in pairs:
        device[dst_i] = host[src_i, layer_id]


_pointer_tables: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}


def _record_pointer_tables(pool: object) -> None:
    """Remember which device layer tensors each of ``pool``'s device pointer tables was built from."""
    for kv in ("k", "v"):
        table, layers = getattr(pool, f"device_{kv}_data_ptrs", None), getattr(pool, f"device_{kv}_buffers", None)
        if table is not None and layers is not None:
            _pointer_tables[id(table)] = (table, tuple(layers))  # holds the table: its id stays its own


def _layers_of(op: str, table: torch.Tensor, num_layers: int) -> tuple[torch.Tensor, ...]:
    """The device layer tensors whose addresses ``table`` holds (as recorded from the host pool)."""
    entry = _pointer_tables.get(id(table))
    _check(entry is not None and entry[0] is table, op, "a pointer table no host pool was built with")
    layers = entry[1]
    _check(table.dtype == torch.uint64 and table.dim() == 1, op, f"a {table.dtype} {tuple(table.shape)} table")
    _check(table.tolist() == [t.data_ptr() for t in layers], op, "the table no longer holds its layers' addresses")
    _check(len(layers) == num_layers, op, f"num_layers {num_layers}, the table has {len(layers)} (the kernel checks)")
    return layers


def transfer_kv_all_layer_lf_pf(src_k_layers: torch.Tensor, dst_k: torch.Tensor, src_v_layers: torch.Tensor,
                                dst_v: torch.Tensor, src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                item_size: int, dst_layout_dim: int, num_layers: int, block_quota: int = 2,
                                num_warps_per_block: int = 32) -> None:
    """Every device layer (a pointer table each for K and V) -> host ``page_first`` K and V:
    ``dst[dst_indices[i], layer] = layers[layer][src_indices[i]]`` (backup, ``backup_from_device_all_layer``).
    ``block_quota`` / ``num_warps_per_block`` only shape the CUDA launch."""
    op = "transfer_kv_all_layer_lf_pf"
    src_i, dst_i = _items(op, src_indices, dst_indices)
    plans = []
    for kv, table, dst in (("K", src_k_layers, dst_k), ("V", src_v_layers, dst_v)):
        host = _page_first(op, dst, item_size, dst_layout_dim, f"host {kv}")
        _check(num_layers <= host.shape[1], op, f"{num_layers} layers into a host tensor of {host.shape[1]}")
        layers = [_rows(op, t, item_size, f"device {kv} layer {i}")
                  for i, t in enumerate(_layers_of(op, table, num_layers))]
        plans.append((host, layers))
    _called(op)
    for host, layers in plans:
        for layer, device in enumerate(layers):
            host[dst_i, layer] = device[src_i]


def install() -> None:
    from sglang.srt.mem_cache.pool_host import base, common, mha

    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0  # read by host_memory_budget_bytes at each call

    def no_host_register(buffer: torch.Tensor, registration_granularity_bytes: int | None = None) -> None:
        return None  # CPU only: nothing to pin for

    common._cuda_host_register = no_host_register
    torch.cpu.Stream.synchronize = lambda self: None
    mha.transfer_kv_direct = transfer_kv_direct
    mha.transfer_kv_per_layer_direct_pf_lf = transfer_kv_per_layer_direct_pf_lf
    mha.transfer_kv_all_layer_direct_lf_pf = transfer_kv_all_layer_direct_lf_pf
    mha.transfer_kv_per_layer_pf_lf = transfer_kv_per_layer_pf_lf
    mha.transfer_kv_all_layer_lf_pf = transfer_kv_all_layer_lf_pf

    host_pool_init = mha.MHATokenToKVPoolHost.__init__

    def recording_init(self, *args, **kwargs) -> None:  # the pool holds the tables and the layers they list
        host_pool_init(self, *args, **kwargs)
        _record_pointer_tables(self)

    mha.MHATokenToKVPoolHost.__init__ = recording_init
    log.warning("test-only HiCache CPU replacements installed (tests/sglang_engine/hicache_cpu.py)")
