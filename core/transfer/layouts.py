"""How an engine's paged KV cache is addressed, whatever the engine.

Every engine format kvstrata supports reduces to one strided description: for
layer ``l`` and KV plane ``k`` (K or V; only one for MLA) the bytes of token
offset ``t`` in block ``b`` for head ``h`` start at

    region[r] + offset[l][k] + b * block_stride + t * token_stride + h * head_stride

and run ``head_bytes`` contiguous bytes. vLLM's per-layer views (LBNHC or LBHNC),
SGLang's per-layer K and V token-slot buffers, TensorRT-LLM's block-major pool
and our reference engine's blocks all fit this, so the planner, the pure-torch
reference and the CUDA kernel need exactly one addressing scheme. Constructors
for each engine live with their adapters or at the bottom of this module.

The L1 object for a chunk is the dense ``[kv, layer, token, head, head_bytes]``
byte array (``[kv, layer, token, hidden]`` in the specification's words).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

PLACEMENT_SERVER = "server"
"""The server writes into the engine's cache (shared memory on CPU, CUDA IPC on GPU)."""
PLACEMENT_ENGINE = "engine"
"""The engine's worker runs the plan itself, reading the server's L1 pool read-only."""

PAGES_SUFFIX = "-pages"
"""How a format that moves an engine's pages as opaque rows is named (``PagedKVLayout.moves_pages``)."""
DTYPE_SIZES = {
    "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1, "int8": 1,
}


class LayoutError(ValueError):
    """A KV cache descriptor is inconsistent or names something unsupported."""


@dataclass(frozen=True)
class Region:
    """One memory allocation holding (part of) an engine's KV cache.

    kind ``shm``: a POSIX shared-memory segment ``name`` of ``size`` bytes.
    kind ``cuda_ipc``: a CUDA allocation exported by the engine; ``handle`` holds
    the exported fields (see ``kvstrata.native.cuda_ipc``).
    kind ``local``: memory only the registering process can see (engine placement).
    """

    kind: str
    size: int
    name: str = ""
    handle: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "size": self.size, "name": self.name, "handle": self.handle}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Region":
        if not isinstance(d, dict):
            raise LayoutError(f"malformed KV cache descriptor: a region must be a map, got {type(d).__name__}")
        handle = d.get("handle") or {}
        if not isinstance(handle, dict):
            raise LayoutError(f"malformed KV cache descriptor: region field handle must be a map, got "
                              f"{type(handle).__name__}")
        return cls(_typed(d, "kind", str, "region"), _typed(d, "size", int, "region"),
                   _typed(d, "name", str, "region", default=""), dict(handle))


def _typed(d: dict[str, Any], name: str, kind: type, what: str = "descriptor", default: Any = None) -> Any:
    """Field ``name`` of a wire map, exactly of ``kind`` (an int is never a bool, a float or a string): a
    descriptor is checked, not coerced, so a malformed one is refused naming the field."""
    if name not in d:
        if default is not None:
            return default
        raise LayoutError(f"malformed KV cache descriptor: {what} field {name} is missing")
    value = d[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise LayoutError(f"malformed KV cache descriptor: {what} field {name} must be {kind.__name__}, got "
                          f"{type(value).__name__} {value!r:.40}")
    return value


def _ints(values: Any, name: str, length: int | None = None) -> tuple[int, ...]:
    if not isinstance(values, (list, tuple)) or any(not isinstance(v, int) or isinstance(v, bool) for v in values) \
            or (length is not None and len(values) != length):
        raise LayoutError(f"malformed KV cache descriptor: field {name} must be a list of "
                          f"{length or 'any number of'} ints, got {values!r:.60}")
    return tuple(values)


@dataclass(frozen=True)
class PagedKVLayout:
    """The strided description of one engine's paged KV cache (see the module docstring)."""

    format: str
    num_layers: int
    kv_size: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_bytes: int
    dtype: str
    offsets: tuple[tuple[tuple[int, int], ...], ...]
    """offsets[l][k] = (region index, byte offset of block 0, token 0, head 0)."""
    block_stride: int
    token_stride: int
    head_stride: int
    regions: tuple[Region, ...]
    layer_groups: tuple[tuple[int, ...], ...] = ()
    """Layers per KV-cache group; empty means one group of all layers. More than
    one group is a hybrid model: chunk-major only."""
    plane_strides: tuple[tuple[int, int], ...] = ()
    """Per KV plane, (token stride, element stride) in bytes, for a cache whose planes are not all addressed by
    ``token_stride`` with each head's elements side by side: vLLM's CPU kernel stores K transposed in a page (a
    head's elements a block's tokens apart, its tokens one element apart) and V row by row. Empty: every plane
    is. Copied with torch on CPU only (the CUDA copy paths refuse it)."""

    def __post_init__(self) -> None:
        self.validate()

    # --- derived sizes -------------------------------------------------------------

    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def token_bytes_per_layer(self) -> int:
        """Bytes of one token in one layer and one KV plane (``hidden`` in bytes)."""
        return self.num_heads * self.head_bytes

    def object_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.kv_size, self.num_layers, num_tokens, self.num_heads, self.head_bytes)

    def object_bytes(self, num_tokens: int) -> int:
        return self.kv_size * self.num_layers * num_tokens * self.token_bytes_per_layer

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        return self.layer_groups or (tuple(range(self.num_layers)),)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    def group_of_layer(self) -> list[int]:
        out = [0] * self.num_layers
        for g, layers in enumerate(self.groups):
            for l in layers:
                out[l] = g
        return out

    def shape_signature(self) -> tuple[int, int, int, int]:
        """What an L1 object must match to be scattered into this cache."""
        return (self.kv_size, self.num_layers, self.num_heads, self.head_bytes)

    def plane_addressing(self, plane: int) -> tuple[int, int]:
        """(token stride, element stride) in bytes of KV plane ``plane`` (see :attr:`plane_strides`)."""
        return self.plane_strides[plane] if self.plane_strides else (self.token_stride, self.element_size)

    @property
    def engine_format(self) -> str:
        """The engine's format this layout describes: ``format`` without what kvstrata added after a ``+`` (an
        engine placement's registration area is ``<engine format>+registration``)."""
        return self.format.split("+")[0]

    @property
    def moves_pages(self) -> bool:
        """Whether this layout moves an engine's pages as opaque rows (a format named ``...-pages``) instead of
        kvstrata's per-token ``[kv, layer, token, head, bytes]``: its objects hold that engine's own packing."""
        return self.engine_format.endswith(PAGES_SUFFIX)

    def object_form(self) -> str:
        """What an object's bytes mean beyond its shape, part of every chunk's key (``CacheKey.dtype``): the
        dtype for a per-token layout, which every engine of the same model and dtype shares; the format for
        one that moves pages, whose bytes only an engine packing them alike can read."""
        return self.engine_format if self.moves_pages else self.dtype

    # --- checks --------------------------------------------------------------------

    def validate(self) -> None:
        def need(cond: bool, what: str) -> None:
            if not cond:
                raise LayoutError(f"KV cache descriptor ({self.format}): {what}")

        need(self.dtype in DTYPE_SIZES, f"dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        for name in ("num_layers", "kv_size", "num_blocks", "block_size", "num_heads", "head_bytes"):
            need(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        need(self.kv_size in (1, 2), f"kv_size must be 1 (MLA) or 2, got {self.kv_size}")
        need(self.head_bytes % self.element_size == 0,
             f"head_bytes {self.head_bytes} is not a multiple of the {self.dtype} element size")
        need(len(self.offsets) == self.num_layers,
             f"offsets lists {len(self.offsets)} layers, num_layers is {self.num_layers}")
        need(len(self.regions) > 0, "no memory regions")
        for name in ("block_stride", "token_stride", "head_stride"):
            need(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        for i, region in enumerate(self.regions):
            need(region.size > 0, f"region {i} has size {region.size}")
        # With positive strides the highest byte any (block, token, head) reaches is off + span - 1, the
        # lowest off: both inside the region means every byte a copy can address is.
        if self.plane_strides:
            need(len(self.plane_strides) == self.kv_size,
                 f"plane_strides lists {len(self.plane_strides)} planes, kv_size is {self.kv_size}")
            need(all(ts > 0 and es > 0 for ts, es in self.plane_strides),
                 f"plane_strides must be positive, got {self.plane_strides}")
        elements = self.head_bytes // self.element_size

        def span(plane: int) -> int:
            token_stride, element_stride = self.plane_addressing(plane)
            return ((self.num_blocks - 1) * self.block_stride + (self.block_size - 1) * token_stride
                    + (self.num_heads - 1) * self.head_stride + (elements - 1) * element_stride
                    + self.element_size)

        for l, per_kv in enumerate(self.offsets):
            need(len(per_kv) == self.kv_size, f"layer {l} has {len(per_kv)} KV planes, kv_size is {self.kv_size}")
            for k, (r, off) in enumerate(per_kv):
                need(0 <= r < len(self.regions), f"layer {l} plane {k} names region {r}, only {len(self.regions)}")
                need(off >= 0 and off + span(k) <= self.regions[r].size,
                     f"layer {l} plane {k} spans bytes [{off}, {off + span(k)}) past region {r} of "
                     f"{self.regions[r].size} bytes")
        if self.layer_groups:
            flat = sorted(l for g in self.layer_groups for l in g)
            need(flat == list(range(self.num_layers)), "layer_groups must cover every layer exactly once")

    def check_block_ids(self, block_ids: Sequence[Sequence[int]], num_tokens: int) -> None:
        """Raise LayoutError unless block_ids name enough valid blocks for num_tokens per group."""
        if len(block_ids) != len(self.groups):
            raise LayoutError(
                f"block_ids has {len(block_ids)} KV groups, the registered cache has {len(self.groups)}"
            )
        needed = -(-num_tokens // self.block_size)
        for g, ids in enumerate(block_ids):
            if len(ids) < needed:
                raise LayoutError(f"group {g}: {len(ids)} block ids cover fewer than the {num_tokens} tokens asked")
            head = ids[:needed]
            if head and 0 <= min(head) and max(head) < self.num_blocks:
                continue  # the usual case, checked at C speed
            bad = [b for b in head if not 0 <= b < self.num_blocks]
            if bad:
                raise LayoutError(f"group {g}: block ids {bad[:5]} are outside [0, {self.num_blocks})")

    # --- wire ----------------------------------------------------------------------

    def to_wire(self, placement: str) -> dict[str, Any]:
        return {
            "format": self.format, "placement": placement, "num_layers": self.num_layers,
            "kv_size": self.kv_size, "num_blocks": self.num_blocks, "block_size": self.block_size,
            "num_heads": self.num_heads, "head_bytes": self.head_bytes, "dtype": self.dtype,
            "offsets": [[list(o) for o in per_kv] for per_kv in self.offsets],
            "block_stride": self.block_stride, "token_stride": self.token_stride,
            "head_stride": self.head_stride, "regions": [r.to_wire() for r in self.regions],
            "layer_groups": [list(g) for g in self.layer_groups],
            **({"plane_strides": [list(p) for p in self.plane_strides]} if self.plane_strides else {}),
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "PagedKVLayout":
        try:
            ints = {name: _typed(d, name, int) for name in ("num_layers", "kv_size", "num_blocks", "block_size",
                                                             "num_heads", "head_bytes", "block_stride",
                                                             "token_stride", "head_stride")}
            offsets = d.get("offsets")
            if not isinstance(offsets, (list, tuple)) or not all(isinstance(per_kv, (list, tuple)) for per_kv in offsets):
                raise LayoutError("malformed KV cache descriptor: field offsets must be a list of per-layer lists, "
                                  f"got {offsets!r:.60}")
            regions = d.get("regions")
            if not isinstance(regions, (list, tuple)):
                raise LayoutError(f"malformed KV cache descriptor: field regions must be a list, got {regions!r:.60}")
            return cls(
                format=_typed(d, "format", str), dtype=_typed(d, "dtype", str), **ints,
                offsets=tuple(tuple(_ints(pair, "offsets", 2) for pair in per_kv) for per_kv in offsets),
                regions=tuple(Region.from_wire(r) for r in regions),
                layer_groups=tuple(_ints(g, "layer_groups") for g in d.get("layer_groups") or ()),
                plane_strides=tuple(_ints(p, "plane_strides", 2) for p in d.get("plane_strides") or ()),
            )
        except LayoutError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise LayoutError(f"malformed KV cache descriptor: {type(exc).__name__}: {exc}") from None


# --- constructors for the formats kvstrata knows -------------------------------------


def blocks_layout(*, num_layers: int, kv_size: int, num_blocks: int, block_size: int, num_heads: int,
                  head_size: int, dtype: str, region: Region, base_offset: int = 0,
                  fmt: str = "blocks") -> PagedKVLayout:
    """The reference engine's cache: one region, ``[layer][kv, block, token, head, head_size]``."""
    eb = DTYPE_SIZES[dtype]
    hb = head_size * eb
    token_stride = num_heads * hb
    block_stride = block_size * token_stride
    plane = num_blocks * block_stride
    return PagedKVLayout(
        format=fmt, num_layers=num_layers, kv_size=kv_size, num_blocks=num_blocks, block_size=block_size,
        num_heads=num_heads, head_bytes=hb, dtype=dtype,
        offsets=tuple(tuple((0, base_offset + (l * kv_size + k) * plane) for k in range(kv_size))
                      for l in range(num_layers)),
        block_stride=block_stride, token_stride=token_stride, head_stride=hb, regions=(region,),
    )


def blocks_layout_bytes(*, num_layers: int, kv_size: int, num_blocks: int, block_size: int, num_heads: int,
                        head_size: int, dtype: str) -> int:
    return num_layers * kv_size * num_blocks * block_size * num_heads * head_size * DTYPE_SIZES[dtype]


def trtllm_pool_layout(*, num_layers: int, num_blocks: int, block_size: int, num_heads: int, head_size: int,
                       dtype: str, region: Region, kv_size: int = 2) -> PagedKVLayout:
    """TensorRT-LLM's block-major pool ``[blocks, layers, kv, heads, tokens, head]`` (HND in a block)."""
    hb = head_size * DTYPE_SIZES[dtype]
    plane = num_heads * block_size * hb
    return PagedKVLayout(
        format="trtllm", num_layers=num_layers, kv_size=kv_size, num_blocks=num_blocks, block_size=block_size,
        num_heads=num_heads, head_bytes=hb, dtype=dtype,
        offsets=tuple(tuple((0, (l * kv_size + k) * plane) for k in range(kv_size)) for l in range(num_layers)),
        block_stride=num_layers * kv_size * plane, token_stride=hb, head_stride=block_size * hb,
        regions=(region,),
    )


def sglang_layout(*, num_layers: int, num_slots: int, page_size: int, num_heads: int, head_size: int,
                  dtype: str, k_regions: Sequence[Region], v_regions: Sequence[Region] | None) -> PagedKVLayout:
    """SGLang's MHATokenToKVPool: per-layer ``[slots, heads, head]`` K and V buffers (one region each).

    ``v_regions=None`` is MLA (one plane). Token slot ``s`` is block ``s // page_size``.
    """
    hb = head_size * DTYPE_SIZES[dtype]
    kv_size = 1 if v_regions is None else 2
    regions = list(k_regions) + (list(v_regions) if v_regions is not None else [])
    offsets = tuple(
        tuple((l + k * num_layers, 0) for k in range(kv_size)) for l in range(num_layers)
    )
    return PagedKVLayout(
        format="sglang", num_layers=num_layers, kv_size=kv_size, num_blocks=num_slots // page_size,
        block_size=page_size, num_heads=num_heads, head_bytes=hb, dtype=dtype, offsets=offsets,
        block_stride=page_size * num_heads * hb, token_stride=num_heads * hb, head_stride=hb,
        regions=tuple(regions),
    )


def vllm_layout(*, num_layers: int, num_blocks: int, block_size: int, num_heads: int, head_size: int,
                dtype: str, region: Region, physical: str, layer_bytes: int | None = None,
                kv_size: int = 2) -> PagedKVLayout:
    """vLLM 0.33's per-layer views over one shared buffer.

    Logical per-layer shape ``[blocks, heads, block_size, head + head_v]`` (K then V in
    the last dim; one plane for MLA). ``physical`` is the order of the layer's
    dims in memory: ``LBNHC`` (block, token, head, channels) or ``LBHNC``
    (block, head, token, channels).
    """
    eb = DTYPE_SIZES[dtype]
    hb = head_size * eb
    channels = kv_size * hb
    if physical == "LBNHC":
        token_stride, head_stride = num_heads * channels, channels
    elif physical == "LBHNC":
        token_stride, head_stride = channels, block_size * channels
    else:
        raise LayoutError(f"unknown vLLM physical layout {physical!r}: expected LBNHC or LBHNC")
    block_stride = block_size * num_heads * channels
    layer_bytes = layer_bytes or num_blocks * block_stride
    return PagedKVLayout(
        format=f"vllm-{physical}", num_layers=num_layers, kv_size=kv_size, num_blocks=num_blocks,
        block_size=block_size, num_heads=num_heads, head_bytes=hb, dtype=dtype,
        offsets=tuple(tuple((0, l * layer_bytes + k * hb) for k in range(kv_size)) for l in range(num_layers)),
        block_stride=block_stride, token_stride=token_stride, head_stride=head_stride, regions=(region,),
    )
