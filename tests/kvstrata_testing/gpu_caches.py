"""Engine KV caches on a GPU, allocated the way each engine allocates them (GPU tests and benchmarks).

Each :class:`GpuKVCache` holds the tensors an engine would hand a connector,
in that engine's own shapes, and derives its byte views from those shapes, not
from :mod:`kvstrata.core.transfer.layouts`. A test that writes through these views and
reads back through them therefore checks the layout descriptors too: a wrong
stride in a descriptor moves bytes somewhere the engine would not look.

* ``vllm-LBNHC`` / ``vllm-LBHNC``: vLLM 0.33, one int8 buffer, each layer an
  ``as_strided`` view of logical shape ``[blocks, heads, block_size, 2*head]``
  (K then V in the last dim) in the physical order named.
* ``vllm-mla``: the same with one latent plane (kv = 1, one head of 576).
* ``sglang``: ``MHATokenToKVPool``'s per-layer ``k_buffer[l]`` / ``v_buffer[l]``
  of ``[slots, heads, head]``; a page of ``block_size`` slots is a block.
* ``sglang-mla``: per-layer ``kv_buffer[l]`` of ``[slots, 1, 576]`` (kv = 1).
* ``trtllm``: TensorRT-LLM's block-major pool ``[blocks, layers, 2, tokens*heads*head]``,
  HND inside a block.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvstrata.core.transfer.layouts import DTYPE_SIZES, sglang_layout, trtllm_pool_layout, vllm_layout

from kvstrata.native.cuda_ipc import export_region

FORMATS = ("vllm-LBNHC", "vllm-LBHNC", "vllm-mla", "sglang", "sglang-mla", "trtllm")
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "float8_e4m3fn": torch.float8_e4m3fn, "uint8": torch.uint8}
MLA_HEAD = 576


def is_mla(fmt: str) -> bool:
    return fmt.endswith("-mla")


class GpuKVCache:
    """One engine's paged KV cache on ``device``, exported for a kvstrata server by CUDA IPC."""

    def __init__(self, fmt: str, *, num_layers: int, num_heads: int, head_size: int, dtype: str,
                 num_blocks: int, block_size: int, device: str | torch.device = "cuda") -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(TORCH_DTYPES)}")
        self.format = fmt
        self.device = torch.device(device)
        self.kv_size = 1 if is_mla(fmt) else 2
        if is_mla(fmt):
            num_heads, head_size = 1, MLA_HEAD
        self.num_layers, self.num_heads, self.head_size = num_layers, num_heads, head_size
        self.dtype, self.tdtype = dtype, TORCH_DTYPES[dtype]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.head_bytes = head_size * DTYPE_SIZES[dtype]
        self.tensors: list[torch.Tensor] = []
        self._views: list[list[torch.Tensor]] = []  # [layer][plane] -> uint8 [blocks, block_size, heads, head_bytes]
        getattr(self, "_build_" + fmt.split("-")[0])()

    # --- per-engine allocation -------------------------------------------------------

    def _build_vllm(self) -> None:
        L, H, D, B, bs, kv = (self.num_layers, self.num_heads, self.head_size, self.num_blocks, self.block_size,
                              self.kv_size)
        es = DTYPE_SIZES[self.dtype]
        channels = kv * D
        layer_elems = B * bs * H * channels
        raw = torch.empty(L * layer_elems * es, dtype=torch.int8, device=self.device)
        typed = raw.view(self.tdtype)
        physical = "LBNHC" if self.format in ("vllm-LBNHC", "vllm-mla") else "LBHNC"
        if physical == "LBNHC":  # memory order block, token, head, channel
            stride = (bs * H * channels, channels, H * channels, 1)
        else:  # block, head, token, channel
            stride = (H * bs * channels, bs * channels, channels, 1)
        self.kv_caches = []  # what vLLM registers: per layer, logical [blocks, heads, block_size, channels]
        for layer in range(L):
            logical = typed.as_strided((B, H, bs, channels), stride, layer * layer_elems)
            self.kv_caches.append(logical)
            per_token = logical.permute(0, 2, 1, 3)  # [blocks, block_size, heads, channels]
            self._views.append([self._bytes(per_token[..., k * D:(k + 1) * D]) for k in range(kv)])
        self.tensors = [raw]
        self.layout = vllm_layout(num_layers=L, num_blocks=B, block_size=bs, num_heads=H, head_size=D,
                                  dtype=self.dtype, region=export_region(raw), physical=physical, kv_size=kv)

    def _build_sglang(self) -> None:
        L, H, D, B, bs = self.num_layers, self.num_heads, self.head_size, self.num_blocks, self.block_size
        slots = B * bs

        def buf() -> torch.Tensor:
            return torch.empty((slots, H, D), dtype=self.tdtype, device=self.device)

        self.k_buffer = [buf() for _ in range(L)]
        self.v_buffer = [buf() for _ in range(L)] if self.kv_size == 2 else None
        for layer in range(L):
            planes = [self.k_buffer[layer]] + ([self.v_buffer[layer]] if self.v_buffer else [])
            self._views.append([self._bytes(p.view(B, bs, H, D)) for p in planes])
        self.tensors = self.k_buffer + (self.v_buffer or [])
        self.layout = sglang_layout(
            num_layers=L, num_slots=slots, page_size=bs, num_heads=H, head_size=D, dtype=self.dtype,
            k_regions=[export_region(t) for t in self.k_buffer],
            v_regions=[export_region(t) for t in self.v_buffer] if self.v_buffer else None)

    def _build_trtllm(self) -> None:
        L, H, D, B, bs = self.num_layers, self.num_heads, self.head_size, self.num_blocks, self.block_size
        pool = torch.empty((B, L, 2, bs * H * D), dtype=self.tdtype, device=self.device)
        self.pool = pool
        for layer in range(L):
            self._views.append([self._bytes(pool[:, layer, k].view(B, H, bs, D).permute(0, 2, 1, 3))
                                for k in range(2)])
        self.tensors = [pool]
        self.layout = trtllm_pool_layout(num_layers=L, num_blocks=B, block_size=bs, num_heads=H, head_size=D,
                                         dtype=self.dtype, region=export_region(pool))

    @staticmethod
    def _bytes(view: torch.Tensor) -> torch.Tensor:
        """A dtype view's bytes (bitwise: no float conversion ever touches the KV)."""
        return view if view.dtype == torch.uint8 else view.view(torch.uint8)

    # --- reading and writing through the engine's own views --------------------------

    def token_view(self, layer: int, plane: int) -> torch.Tensor:
        """uint8 ``[blocks, block_size, heads, head_bytes]`` of one layer's K (0) or V (1)."""
        return self._views[layer][plane]

    def _slots(self, blocks: Sequence[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, end, device=self.device)
        table = torch.as_tensor(list(blocks), dtype=torch.int64, device=self.device)
        return table[pos // self.block_size], pos % self.block_size

    def write(self, kv: torch.Tensor, blocks: Sequence[int], start: int = 0) -> None:
        """Write canonical ``[kv, layers, tokens, heads, head_bytes]`` bytes for positions [start, ...)."""
        b, o = self._slots(blocks, start, start + kv.shape[2])
        for layer in range(self.num_layers):
            for k in range(self.kv_size):
                self.token_view(layer, k)[b, o] = kv[k, layer]

    def read(self, blocks: Sequence[int], start: int, end: int, layers: Sequence[int] | None = None) -> torch.Tensor:
        """Canonical ``[kv, len(layers), tokens, heads, head_bytes]`` bytes of positions [start, end)."""
        b, o = self._slots(blocks, start, end)
        layers = range(self.num_layers) if layers is None else layers
        return torch.stack([torch.stack([self.token_view(layer, k)[b, o] for layer in layers])
                            for k in range(self.kv_size)])

    def poison(self, blocks: Sequence[int], value: int = 0xA5) -> None:
        """Fill blocks with a constant so a check cannot pass on bytes left from before."""
        idx = torch.as_tensor(list(blocks), dtype=torch.int64, device=self.device)
        for layer in range(self.num_layers):
            for k in range(self.kv_size):
                self.token_view(layer, k)[idx] = value

    def random_kv(self, num_tokens: int, seed: int) -> torch.Tensor:
        """Random canonical KV bytes for ``num_tokens`` tokens (every byte value, NaN patterns included)."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        shape = (self.kv_size, self.num_layers, num_tokens, self.num_heads, self.head_bytes)
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=self.device, generator=g)

    def region_tensors(self) -> list[torch.Tensor]:
        """The layout's regions as flat uint8 tensors of this process (for in-process executors)."""
        return [t.view(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.view(-1) for t in self.tensors]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)
