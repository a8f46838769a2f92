"""First-token time on a GPU with the engine computing.

An idle-GPU transfer benchmark (``benchmarks/transfer.py``) cannot see what decides first-token time: while
later layers still copy, the engine is computing earlier ones, and copies that run in another process's CUDA
context are time-sliced against that compute. This benchmark runs the compute.

* The engine: decoder layers of a model shape (``--shape``, :data:`SHAPES`: Llama-3.1-8B by default, a
  Llama-3.1-70B shard of tensor parallelism 8, Qwen2.5-7B, DeepSeek-V2-Lite's MLA; random bf16 weights) whose
  attention reads the cached prefix from the paged KV cache in each engine's own format: vLLM's LBNHC layers,
  SGLang's per-layer ``k_buffer``/``v_buffer``, TensorRT-LLM's ``[blocks, layers, 2, tokens*heads*head]`` pool,
  and vLLM's and SGLang's MLA caches for an MLA shape (``kvstrata_testing.gpu_caches``).
* The load: a 15,104-token cached prefix (1.84 GiB of KV) per request, stored in a real ``kvstrata serve``
  process, plus 256, 1,024 or 2,048 new tokens computed on top of it.
* Arms: ``resident`` (the KV is already in the cache: compute alone), chunk-major (width 0) and layer-major
  widths, each in both placements: ``server`` (the server process writes the cache over CUDA IPC) and
  ``engine`` (engine placement: this process copies from the server's pool with its own streams, through its
  one transfer queue). An engine-placement load starts from where its LOOKUP found the chunks, as the engine runtime does; a placement
  named with ``-retrieve`` (``engine-retrieve``) asks RETRIEVE first instead (that A/B). One named with
  ``-ctasN`` (``engine-ctas33``) bounds the engine-placement scatter kernel to N thread blocks per launch (the
  default is two per SM); ``-bufsN`` (``engine-bufs4``) gives its copies N staging buffers (the default is
  two); ``-priohigh`` (``engine-priohigh``) runs its copy
  and scatter streams at the highest priority (the
  default is normal priority; ``-prio0`` names it); ``-paced`` (``engine-paced``) starts each load's copies only
  once the engine's poll saw the load before it complete (the ``pace_loads`` setting).
* The engine's thread between polls: it sleeps 20 us (``--engine-loop sleep``, the default) or stays in
  Python for 20 us (``spin``), as an engine busy scheduling and launching does; a spinning thread holds the
  GIL, which the copying threads of an engine placement then wait for.
* Concurrency c: c requests arrive together, each with its own prefix. The engine's loop is shaped like
  vLLM's: each step runs one prefill of the requests released since the last step, waiting per layer for
  every released transfer still in flight. Chunk-major serves its transfers one request after another (its
  best order: the next starts when the engine's thread saw the previous one complete, so about one a step);
  ``--chunk-major-together`` adds chunk-major with every request submitted at once, as layer-major's are, and
  ``--serial-widths`` layer-major widths served one after another. Before the concurrency arms, one step of every
  batch size up to the highest concurrency runs once (``--warm-batch-sizes``), as in an engine that has served
  a while: PyTorch loads kernels on first launch, and a load waits for everything queued on the GPU.

First-token time is from the moment the requests are handed to kvstrata (their LOOKUP already answered, as
a scheduler has it) until the step that computed the request has its logits. The ceiling of a layer-major
gain is ``min(transfer, compute) / (transfer + compute)``, transfer being the same placement's chunk-major
transfer time and compute the resident arm, both measured in the same run.

    python benchmarks/ttft.py --out benchmarks/results/ttft-h200.json      # on the GPU machine
    python benchmarks/ttft.py --plot benchmarks/results/ttft-h200.json     # the two PNGs (needs matplotlib)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvstrata.core.engine.slice_width import AUTO

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from shapes import SHAPES, Shapes  # noqa: E402  (a sibling module)
from transfer import copier_engine, device_info, wait_pool_registered  # noqa: E402  (a sibling script)

ENGINE_FORMATS = ("vllm-LBNHC", "sglang", "trtllm")
PACED_SUFFIX = "-paced"
"""An engine placement named with ``-paced`` (``engine-paced``) has ``pace_loads`` on: its queue starts each load's
copies only once the engine's thread settled the load before it."""
LOCATE_SUFFIX = "-retrieve"
"""A engine placement ending in ``-retrieve`` asks RETRIEVE where each load's chunks are, instead of starting from
the LOOKUP's reply."""


def split_suffix(placement: str, suffixes: dict[str, Any]) -> tuple[str, Any]:
    """(the placement without the one of ``suffixes`` it ends with, that suffix's value), or (it, None)."""
    for suffix, value in suffixes.items():
        if placement.endswith(suffix):
            return placement.removesuffix(suffix), value
    return placement, None


def numbered_suffix(placement: str, suffix: str) -> tuple[str, int | None]:
    """(the placement without a ``{suffix}N`` ending, N), or (it, None)."""
    base, sep, n = placement.rpartition(suffix)
    return (base, int(n)) if sep and n.isdigit() else (placement, None)


def scatter_ctas(placement: str) -> tuple[str, int | None]:
    """(the placement without a ``-ctasN`` suffix, N or None: the copier's default)."""
    return numbered_suffix(placement, "-ctas")


def staging_buffers(placement: str) -> tuple[str, int | None]:
    """(the placement without a ``-bufsN`` suffix, N or None: the copier's default number of staging buffers)."""
    return numbered_suffix(placement, "-bufs")


PRIORITY_SUFFIXES = {"-prio0": 0, "-priohigh": -1}
"""An engine-placement placement ending in ``-priohigh`` runs its copy and scatter streams at the highest priority
(-1), one ending in ``-prio0`` at normal priority (0, the default: the highest was no faster with the engine
computing)."""


def copy_priority(placement: str) -> tuple[str, int | None]:
    """(the placement without a priority suffix, the copier's stream priority, or None for its default)."""
    return split_suffix(placement, PRIORITY_SUFFIXES)


TWIN_SUFFIX = "-twin"
"""An engine-placement placement ending in ``-twinN`` (``worker-twin2``) is its base's settings under another name:
identical arms, for the arm-to-arm spread's diagnosis."""


def locates_by_lookup(placement: str) -> bool:
    """Whether an engine-placement arm starts its loads from the LOOKUP's locations (see :data:`LOCATE_SUFFIX`)."""
    base, _ = numbered_suffix(placement, TWIN_SUFFIX)
    return not base.startswith("server") and not base.endswith(LOCATE_SUFFIX)


BASE_PLACEMENTS = ("server", "engine")


@dataclass(frozen=True)
class ArmSettings:
    """What a ``--placements`` name asks for (None: the default)."""

    base: str
    priority: int | None = None
    ctas: int | None = None
    buffers: int | None = None
    paced: bool = False


def arm_settings(placement: str) -> ArmSettings:
    """Parse a placement name: a base, then suffixes in the order ``-paced``, ``-bufsN``, ``-ctasN``,
    ``-prio0``/``-priohigh``, ``-retrieve``, ``-twinN`` (any may be left out). A name that leaves anything else is
    refused, so a misspelt arm cannot run the default settings under another name."""
    base, _twin = numbered_suffix(placement, TWIN_SUFFIX)
    base, priority = copy_priority(base.removesuffix(LOCATE_SUFFIX))
    base, ctas = scatter_ctas(base)
    base, buffers = staging_buffers(base)
    paced = base.endswith(PACED_SUFFIX)
    base = base.removesuffix(PACED_SUFFIX)
    if base not in BASE_PLACEMENTS:
        raise ValueError(f"placement {placement!r}: {base!r} is not one of {', '.join(BASE_PLACEMENTS)} (suffixes "
                         "go in the order -paced, -bufsN, -ctasN, -prio0/-priohigh, "
                         "-retrieve)")
    if base == "server" and ((ctas, buffers, priority, _twin) != (None,) * 4
                             or placement.endswith(LOCATE_SUFFIX) or paced):
        raise ValueError(f"placement {placement!r}: the copier and queue suffixes are for engine-placement arms only")
    return ArmSettings(base, priority, ctas, buffers, paced)




# --- the engine's compute --------------------------------------------------------------


class Decoder:
    """Llama-shaped decoder layers with random weights; attention reads the prefix from the paged cache."""

    def __init__(self, s: Shapes, device: torch.device, seed: int = 0) -> None:
        self.s = s
        g = torch.Generator(device=device).manual_seed(seed)
        dt = torch.bfloat16

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dt)

        self.layers = [dict(**self.attention_weights(w), gate_up=w(s.hidden, 2 * s.mlp), down=w(s.mlp, s.hidden))
                       for _ in range(s.layers)]
        self.lm_head = w(s.hidden, s.vocab)
        self._masks: dict[tuple[int, int], torch.Tensor] = {}

    def attention_weights(self, w: Any) -> dict[str, torch.Tensor]:
        s = self.s
        return dict(qkv=w(s.hidden, (s.heads + 2 * s.kv_heads) * s.head), o=w(s.heads * s.head, s.hidden))

    def mask(self, prefix: int, new: int, device: torch.device) -> torch.Tensor:
        """New token i attends to the whole prefix and to new tokens 0..i."""
        key = (prefix, new)
        if key not in self._masks:
            i = torch.arange(new, device=device)[:, None]
            j = torch.arange(prefix + new, device=device)[None, :]
            self._masks[key] = j <= prefix + i
        return self._masks[key]

    def layer(self, layer: int, x: torch.Tensor, prefixes: list[tuple[torch.Tensor, Any]],
              new: int) -> torch.Tensor:
        """``x``: ``[len(prefixes) * new, hidden]``; ``prefixes``: per request what :func:`prefix_reader` read."""
        s, p = self.s, self.layers[layer]
        x = x + self.attend(p, torch.nn.functional.rms_norm(x, (s.hidden,)), prefixes, new)
        h = torch.nn.functional.rms_norm(x, (s.hidden,))
        gate, up = (h @ p["gate_up"]).chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gate) * up) @ p["down"]

    def attend(self, p: dict[str, torch.Tensor], h: torch.Tensor, prefixes: list[tuple[torch.Tensor, Any]],
               new: int) -> torch.Tensor:
        """Grouped-query attention of each request's new tokens over its ``[P, kv_heads, head]`` K and V."""
        s = self.s
        q, k, v = (h @ p["qkv"]).split([s.heads * s.head, s.kv_heads * s.head, s.kv_heads * s.head], dim=-1)
        outs = []
        for r, (pk, pv) in enumerate(prefixes):
            rows = slice(r * new, (r + 1) * new)
            qr = q[rows].view(new, s.heads, s.head).transpose(0, 1)[None]
            kr = torch.cat([pk, k[rows].view(new, s.kv_heads, s.head)]).repeat_interleave(s.heads // s.kv_heads, 1)
            vr = torch.cat([pv, v[rows].view(new, s.kv_heads, s.head)]).repeat_interleave(s.heads // s.kv_heads, 1)
            a = torch.nn.functional.scaled_dot_product_attention(
                qr, kr.transpose(0, 1)[None], vr.transpose(0, 1)[None], attn_mask=self.mask(pk.shape[0], new, h.device))
            outs.append(a[0].transpose(0, 1).reshape(new, s.heads * s.head))
        return torch.cat(outs) @ p["o"]

    def logits(self, x: torch.Tensor, batch: int, new: int) -> torch.Tensor:
        last = x.view(batch, new, -1)[:, -1]
        return torch.nn.functional.rms_norm(last, (self.s.hidden,)) @ self.lm_head


class MlaDecoder(Decoder):
    """DeepSeek-shaped layers: attention over a cached latent, up-projected per head as an engine's MLA prefill
    does (K = the latent's up-projection beside the shared rope part, V another up-projection)."""

    def attention_weights(self, w: Any) -> dict[str, torch.Tensor]:
        s = self.s
        return dict(q=w(s.hidden, s.heads * (s.nope + s.rope)), kv_a=w(s.hidden, s.latent + s.rope),
                    kv_b=w(s.latent, s.heads * (s.nope + s.v_head)), o=w(s.heads * s.v_head, s.hidden))

    def attend(self, p: dict[str, torch.Tensor], h: torch.Tensor, prefixes: list[tuple[torch.Tensor, Any]],
               new: int) -> torch.Tensor:
        """``prefixes``: per request its ``[P, 1, latent + rope]`` cached latent (and None)."""
        s = self.s
        q = (h @ p["q"]).view(-1, s.heads, s.nope + s.rope)
        latent_new = h @ p["kv_a"]
        outs = []
        for r, (prefix_latent, _) in enumerate(prefixes):
            rows = slice(r * new, (r + 1) * new)
            latent = torch.cat([prefix_latent[:, 0], latent_new[rows]])  # [T, latent + rope]
            kv = (latent[:, :s.latent] @ p["kv_b"]).view(-1, s.heads, s.nope + s.v_head)
            rope = latent[:, None, s.latent:].expand(-1, s.heads, s.rope)
            k = torch.cat([kv[..., :s.nope], rope], dim=-1)
            v = kv[..., s.nope:]
            a = torch.nn.functional.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                attn_mask=self.mask(prefix_latent.shape[0], new, h.device))
            outs.append(a[0].transpose(0, 1).reshape(new, s.heads * s.v_head))
        return torch.cat(outs) @ p["o"]


def make_decoder(s: Shapes, device: torch.device) -> Decoder:
    return MlaDecoder(s, device) if s.mla else Decoder(s, device)


def prefix_reader(cache: Any, blocks: list[int], s: Shapes):
    """A function ``layer -> (K, V)`` of one request's prefix, read from the paged cache in its engine's format."""
    idx = torch.as_tensor(blocks, dtype=torch.int64, device=cache.device)
    P = len(blocks) * s.block
    if cache.format == "vllm-mla":
        def read(layer: int):  # vLLM MLA: [blocks, 1, block_size, latent + rope]
            return cache.kv_caches[layer][idx].permute(0, 2, 1, 3).reshape(P, 1, s.head), None
    elif cache.format == "sglang-mla":
        slots = (idx[:, None] * s.block + torch.arange(s.block, device=cache.device)[None]).reshape(-1)

        def read(layer: int):  # SGLang MLA: per-layer kv_buffer [slots, 1, latent + rope]
            return cache.k_buffer[layer][slots], None
    elif cache.format.startswith("vllm"):
        def read(layer: int):  # vLLM: [blocks, heads, block_size, 2*head], K then V in the last dim
            kv = cache.kv_caches[layer][idx].permute(0, 2, 1, 3).reshape(P, s.kv_heads, 2 * s.head)
            return kv[..., :s.head], kv[..., s.head:]
    elif cache.format == "sglang":
        slots = (idx[:, None] * s.block + torch.arange(s.block, device=cache.device)[None]).reshape(-1)

        def read(layer: int):  # SGLang: per-layer [slots, heads, head]
            return cache.k_buffer[layer][slots], cache.v_buffer[layer][slots]
    elif cache.format == "trtllm":
        def read(layer: int):  # TensorRT-LLM: [blocks, layers, 2, heads*block*head], HND inside a block
            kv = cache.pool[idx, layer].view(len(blocks), 2, s.kv_heads, s.block, s.head)
            kv = kv.permute(1, 0, 3, 2, 4).reshape(2, P, s.kv_heads, s.head)
            return kv[0], kv[1]
    else:
        raise ValueError(f"no prefix reader for format {cache.format!r}")
    return read


# --- layer timing probes ---------------------------------------------------------------


class ProbingBackend:
    """Wraps the engine's CUDA event backend; while ``probe`` is set, each layer wait also records, on an
    otherwise idle stream, when that slice's bytes landed (the timeline's arrival marks)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name, self.device = inner.name, inner.device
        self.side = torch.cuda.Stream()
        self.probe: list[torch.cuda.Event] | None = None

    def wait(self, event: Any) -> None:
        if self.probe is not None and event is not None:
            self.side.wait_event(event)
            mark = torch.cuda.Event(enable_timing=True)
            mark.record(self.side)
            self.probe.append(mark)
        self.inner.wait(event)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class CopyProbe:
    """Wraps an engine-placement copier's CUDA extension: while ``marks`` is set, each copy-engine copy and each
    scatter launch is bracketed by timing events on its own stream, so a run shows per slice when the copy stream
    started and finished a piece, and when the kernel stream had its staging filled and finished scattering it.

    A diagnostic of where an arm's load under compute loses time; it adds two event records per call (a few
    microseconds of host time each), so probed runs are not the ones the targets are judged on."""

    def __init__(self, ext: Any, copy_stream: int | None) -> None:
        self.ext = ext
        self.copy_stream = copy_stream
        self.marks: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] | None = None
        self._streams: dict[int, torch.cuda.ExternalStream] = {}

    def _bracket(self, kind: str, stream: int, call: Any, *args: Any) -> Any:
        if self.marks is None:
            return call(*args)
        s = self._streams.get(stream)
        if s is None:
            s = self._streams[stream] = torch.cuda.ExternalStream(stream)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(s)  # creates the events' handles; the records that count go through the copier's issuer, in
        b.record(s)  # order with the call they bracket
        self.ext.event_record(a.cuda_event, stream)
        out = call(*args)
        self.ext.event_record(b.cuda_event, stream)
        self.marks.setdefault(kind, []).append((a, b))
        return out

    def memcpy2d_runs(self, rows: int, n: int, index: int, stream: int) -> Any:
        kind = "h2d" if stream == self.copy_stream else "direct"
        return self._bracket(kind, stream, self.ext.memcpy2d_runs, rows, n, index, stream)

    def copy(self, *args: Any) -> Any:
        return self._bracket("scatter" if args[0] else "gather", args[-1], self.ext.copy, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ext, name)


def copy_summary(copies: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """What one probed run's brackets say (ms from the run's start): the copy engine's busy time per piece and the
    gaps between pieces, and how long each piece's scatter ended after its copy did."""
    h2d, scatter = copies.get("h2d", []), copies.get("scatter", [])
    out: dict[str, Any] = {"pieces": len(h2d)}
    if h2d:
        out["h2d_first_start_ms"] = round(h2d[0][0], 3)
        out["h2d_last_end_ms"] = round(h2d[-1][1], 3)
        out["h2d_busy_ms"] = round(sum(b - a for a, b in h2d), 3)
        out["h2d_gaps_ms"] = round(sum(max(0.0, h2d[i + 1][0] - h2d[i][1]) for i in range(len(h2d) - 1)), 3)
        out["h2d_ms_per_piece"] = [round(b - a, 3) for a, b in h2d]
    if scatter:
        out["scatter_last_end_ms"] = round(scatter[-1][1], 3)
        out["scatter_busy_ms"] = round(sum(b - a for a, b in scatter), 3)
        out["scatter_ms_per_piece"] = [round(b - a, 3) for a, b in scatter]
        if len(scatter) == len(h2d):
            out["scatter_end_after_h2d_end_ms"] = [round(s[1] - h[1], 3) for s, h in zip(scatter, h2d)]
    return out


def probe_arms(rig: FormatRig, client: Any, model: Decoder, new: int, reps: int) -> dict[str, Any]:
    """``--probe-copies``: each engine-placement arm at width 1, ``reps`` times, with its copies bracketed."""
    out: dict[str, Any] = {}
    for placement, worker in rig.workers.items():
        e = copier_engine(worker)
        if e is None:
            continue
        probe = CopyProbe(e.ext, e.copy_stream.cuda_stream if e.copy_stream is not None else None)
        e.ext = probe
        try:
            runs = [run_arm(rig, client, model, placement, 1, 1, new, probe=probe) for _ in range(reps)]
        finally:
            e.ext = probe.ext
        out[placement] = {"ttft_ms": [round(r["ttft_ms"][0], 3) for r in runs],
                          "transfer_ms": [round(r["transfer_ms"][0], 3) for r in runs if "transfer_ms" in r],
                          "copies": [copy_summary(r["copies"]) for r in runs]}
    return out


def prewarm(engine: Any, what: str, slice_bytes: int) -> None:
    """Diagnostic (``--prewarm``): allocate an arm's lazily grown token table and/or staging buffers now instead of at
    its first transfer (both come from its copier's kernel stream either way)."""
    if what in ("tables", "both"):
        engine.release_table(engine._lease_table(1 << 15, 3 << 15))
    if what in ("staging", "both"):
        for b in range(engine.config.staging_buffers):
            engine.staging(b, min(slice_bytes, engine.config.staging_bytes))


# --- one engine format, its workers and runs --------------------------------------------


@dataclass
class Request:
    index: int
    prompt: list[int]
    blocks: list[int]
    reader: Any = None


@dataclass
class FormatRig:
    fmt: str
    cache: Any
    requests: list[Request]
    workers: dict[str, Any] = field(default_factory=dict)
    backends: dict[str, ProbingBackend] = field(default_factory=dict)
    staging: list[Any] = field(default_factory=list)
    clients: list[Any] = field(default_factory=list)
    """Connections of the engine-placement arms (the server placement's arm uses the run's client, which stores
    the prompts)."""
    register_s: dict[str, float] = field(default_factory=dict)
    streams: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Engine-placement arms: their copier's kernel and copy streams (torch ``stream_id``) and where its copies
    read and stage (:func:`note_copiers`), to relate an arm's speed under compute to what it got."""


def build_rig(fmt: str, client: Any, s: Shapes, prompts: list[list[int]], prefix: int, placements: list[str],
              chunk: int, instance_base: int, stream_pad: int = 0, prewarm_what: str = "none"):
    """``stream_pad``: take that many more streams from torch's pool before each engine-placement arm's copier
    takes its own (a diagnostic of which pool streams the copier gets; 0 in every recorded run but where said).
    ``prewarm_what``: see :func:`prewarm` ("none" in every recorded run but where said)."""
    from kvstrata.core.engine.engine_placement import EnginePlacement
    from kvstrata.core.engine.server_placement import ServerPlacement
    from kvstrata.core.engine.registration_area import RegistrationArea
    from kvstrata.core.wire.client import CacheClient
    from kvstrata.native.cuda_events import CudaEventBackend
    from kvstrata.native.cuda_executor import ENGINE_COPY_PRIORITY, NO_DIRECT_COPIES, CudaTransferConfig
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from kvstrata_testing.gpu_caches import GpuKVCache  # engine-format GPU caches: test support, not shipped

    nb = prefix // s.block
    cache = GpuKVCache(fmt, num_layers=s.layers, num_heads=s.kv_heads, head_size=s.head, dtype="bfloat16",
                       num_blocks=nb * len(prompts) + 1, block_size=s.block)
    reqs = [Request(i, p, list(range(i * nb, (i + 1) * nb))) for i, p in enumerate(prompts)]
    for r in reqs:
        r.reader = prefix_reader(cache, r.blocks, s)
    rig = FormatRig(fmt, cache, reqs)
    for n, placement in enumerate(placements):
        arm = arm_settings(placement)
        base = arm.base
        config = None if (arm.ctas, arm.priority, arm.buffers) == (None, None, None) else CudaTransferConfig(
            max_ctas=arm.ctas or 0, direct_copy_min_run=NO_DIRECT_COPIES,
            staging_buffers=arm.buffers or CudaTransferConfig.staging_buffers,
            stream_priority=ENGINE_COPY_PRIORITY if arm.priority is None else arm.priority)
        backend = ProbingBackend(CudaEventBackend("cuda:0", transfer_config=config))
        server = base == "server"
        arm_client = client
        if not server:  # a connection of its own
            arm_client = CacheClient(client.address, timeout=120.0)
            rig.clients.append(arm_client)
        if server:
            worker = ServerPlacement(arm_client, instance_base + n, cache.layout, event_backend=backend)
        else:
            for _ in range(stream_pad):
                torch.cuda.Stream()
            staging = RegistrationArea(cache.layout, chunk_size=chunk)
            rig.staging.append(staging)
            worker = EnginePlacement(arm_client, instance_base + n, cache.layout, event_backend=backend,
                                     local_regions=cache.region_tensors(),
                                     registration_layout=staging.layout, pace_loads=arm.paced)
        t = time.perf_counter()
        worker.register()
        rig.register_s[placement] = round(time.perf_counter() - t, 3)
        background_s = wait_pool_registered(worker)  # timed runs copy from registered memory
        if background_s is not None:
            rig.register_s[f"{placement}/background"] = background_s
        if prewarm_what != "none" and copier_engine(worker) is not None:
            prewarm(copier_engine(worker), prewarm_what, s.kv_planes * prefix * s.kv_heads * s.head * 2)
        rig.workers[placement], rig.backends[placement] = worker, backend
    return rig


def note_copiers(rig: FormatRig) -> None:
    """Fill ``rig.streams`` for each engine-placement arm: its copier's streams and where its copies read and stage
    (host and device addresses of the pool's mapping, its staging buffers and token tables), for the arm-to-arm
    spread's diagnosis. After the arms ran, so the staging buffers and tables exist."""
    for placement, w in rig.workers.items():
        copier = getattr(w, "_copier", None)  # engine placement only: the server's arms copy in its process
        if copier is None:
            continue
        e = copier.engine
        host, _, dev = e._pool_range
        rig.streams[placement] = {"kernel": e.stream.stream_id,
                                  "copy": e.copy_stream.stream_id if e.copy_stream is not None else None,
                                  "pool_host": host, "pool_dev": dev, "staging": [b.data_ptr() for b in e._staging],
                                  "tables": [slot.dev.data_ptr() for slot in e._table_slots]}


def close_rig(rig: FormatRig) -> None:
    for w in rig.workers.values():
        w.close()
    for st in rig.staging:
        st.close()
    for c in rig.clients:
        c.close()


_run_ids = iter(range(1 << 30))


def sleep_between_polls() -> None:
    time.sleep(2e-5)


def spin_between_polls() -> None:
    """An engine whose thread stays in Python between polls (scheduling, launches): it holds the GIL, which
    the interpreter hands to another thread only every switch interval."""
    until = time.perf_counter() + 2e-5
    while time.perf_counter() < until:
        pass


ENGINE_LOOPS = {"sleep": sleep_between_polls, "spin": spin_between_polls}
engine_idle = sleep_between_polls
"""What the engine's thread does between polls (``--engine-loop``)."""


def run_arm(rig: FormatRig, client: Any, model: Decoder, placement: str, width: int | None, conc: int, new: int,
            timeline: bool = False, probe: CopyProbe | None = None, clock_from_lookup: bool = False,
            serial: bool | None = None) -> dict[str, Any]:
    """One measurement: ``conc`` requests arrive together; ``width`` None = resident (no transfer). With
    ``probe`` (the arm's :class:`CopyProbe`), the timeline also has each copy and scatter bracket.
    ``clock_from_lookup``: first-token time counts from before the LOOKUPs (a shared-tier hit's fetch starts
    there), not from the hand-over to kvstrata."""
    from kvstrata.core.engine.requests import ChunkLocations
    from kvstrata.core.store.keys import CacheKey

    s = model.s
    worker = rig.workers.get(placement)
    reqs = rig.requests[:conc]
    tag = next(_run_ids)
    # a lock owner names the loading worker's instance, so that worker may use the locks the scheduler's
    # connection took
    owner = f"@i{worker.instance_id}" if worker is not None else ""
    rids = [f"{rig.fmt}-{placement}-{width}-{tag}-{r.index}{owner}" for r in reqs]
    keys = [CacheKey.for_tokens(rid, r.prompt, model="llama") for rid, r in zip(rids, reqs)]
    located: list[Any] = [None] * conc
    # Every measurement starts with the collector's young generations empty: otherwise a collection of several ms
    # (seen inside a load's planning) lands in whichever measurement crosses its allocation threshold, and two
    # source trees that allocate differently see it in different arms.
    gc.collect()
    torch.cuda.synchronize()
    t_lookup = time.perf_counter()
    if width is not None:
        for i, key in enumerate(keys):  # the scheduler's LOOKUP, answered before the step (locks the chunks)
            reply = client.transport.wait(client.lookup_async(key))
            if reply["hit_tokens"] != key.num_tokens:
                raise RuntimeError(f"LOOKUP for {key.request_id} hit {reply['hit_tokens']} of {key.num_tokens} "
                                   "tokens")
            if locates_by_lookup(placement):
                located[i] = ChunkLocations.from_lookup_reply(reply)
    xs = [torch.randn(new, s.hidden, device="cuda", dtype=torch.bfloat16) for _ in reqs]
    stream = torch.cuda.current_stream()
    backend = rig.backends.get(placement)
    marks: dict[str, list[torch.cuda.Event]] = {"arrived": [], "usable": [], "computed": []}
    # the engine's thread, per layer: before its layer wait, and after it (its launches for the layer follow)
    cpu_marks: dict[str, list[float]] = {"wait_from": [], "usable": []}
    t0_ev = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    if timeline and backend is not None:
        backend.probe = marks["arrived"]
    if probe is not None:
        probe.marks = {}
    t0 = t_lookup if clock_from_lookup else time.perf_counter()
    t0_ev.record(stream)
    if backend is not None:
        backend.side.wait_event(t0_ev)
    serial = served_one_after_another(width, serial)
    submitted = 0

    def submit_next() -> None:
        nonlocal submitted
        i = submitted
        if submit_profiler is not None:
            submit_profiler.enable()
        worker.submit_retrieve(rids[i], keys[i], [reqs[i].blocks], layers_per_slice=width, located=located[i])
        if submit_profiler is not None:
            submit_profiler.disable()
        submitted += 1

    released: list[int] = []
    if width is None:
        released = list(range(conc))
    else:
        for _ in range(1 if serial else conc):
            submit_next()

    def poll() -> None:
        if width is None:
            return
        if serial and submitted < conc:
            rec = worker.records.get(rids[submitted - 1])
            if rec is not None and (rec.completed_at is not None or rec.failure):
                submit_next()
        for rid in worker.get_finished():
            released.append(rids.index(rid))

    ttft: dict[int, float] = {}
    steps = []
    while len(ttft) < conc:
        poll()
        batch = [i for i in released if i not in ttft]
        if not batch:
            engine_idle()
            continue
        step_start = time.perf_counter() - t0
        x = torch.cat([xs[i] for i in batch])
        for layer in range(s.layers):
            if timeline:
                cpu_marks["wait_from"].append(time.perf_counter() - t0)
            if width is not None:
                worker.wait_for_layer(layer)
            if timeline:
                cpu_marks["usable"].append(time.perf_counter() - t0)
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(stream)
                marks["usable"].append(ev)
            x = model.layer(layer, x, [reqs[i].reader(layer) for i in batch], new)
            if timeline:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(stream)
                marks["computed"].append(ev)
        model.logits(x, len(batch), new)
        done = torch.cuda.Event()
        done.record(stream)
        while not done.query():  # the engine's CPU stays free: keep serving the transfers meanwhile
            poll()
            engine_idle()
        t = time.perf_counter() - t0
        steps.append({"requests": batch, "start_ms": step_start * 1e3, "end_ms": t * 1e3})
        for i in batch:
            ttft[i] = t
    out: dict[str, Any] = {"ttft_ms": [ttft[i] * 1e3 for i in range(conc)], "steps": steps}
    if width is not None:
        worker.wait_all()
        recs = [worker.records.pop(rid) for rid in rids]
        bad = [r for r in recs if r.failure or r.fallback]
        if bad:
            raise RuntimeError(f"a load failed or fell back: {bad[0]}")
        wanted = None if placement.startswith("server") else "lookup" if locates_by_lookup(placement) else "retrieve"
        if any(r.located_by != wanted for r in recs):
            raise RuntimeError(f"arm {placement}: loads located by {[r.located_by for r in recs]}, not {wanted}")
        out["submitted_ms"] = [(r.submitted_at - t0) * 1e3 for r in recs]
        out["release_ms"] = [(r.released_at - t0) * 1e3 for r in recs]
        if all(r.last_slice_at is not None for r in recs):  # engine-placement: when the queue enqueued the last slice
            out["last_enqueued_ms"] = [(r.last_slice_at - t0) * 1e3 for r in recs]
        out["transfer_ms"] = [(r.completed_at - t0) * 1e3 for r in recs]
        out["widths"] = [r.layers_per_slice for r in recs]  # what an auto arm chose
        out["stages_ms"] = [load_stages(r) for r in recs]
    torch.cuda.synchronize()
    if timeline:
        if backend is not None:
            backend.probe = None
        out["timeline"] = {k: [t0_ev.elapsed_time(e) for e in v] for k, v in marks.items()}
        out["timeline"].update({f"cpu_{k}": [round(t * 1e3, 4) for t in v] for k, v in cpu_marks.items()})
    if probe is not None:
        out["copies"] = {k: [(t0_ev.elapsed_time(a), t0_ev.elapsed_time(b)) for a, b in v]
                         for k, v in probe.marks.items()}
        probe.marks = None
    return out


LOAD_STAGES = ("first_layer_handed_at", "located_at", "planned_at", "first_slice_at", "last_slice_at", "released_at",
               "completed_at")


def load_stages(rec: Any) -> dict[str, float]:
    """When each step of a load ended, in ms after its submit (engine placement: from the LOOKUP's locations to the
    first and last slice handed to the native thread, the release and the settle; before them, the first layer's
    copy handed over ahead of the plan, where it was)."""
    return {name.removesuffix("_at"): round((getattr(rec, name) - rec.submitted_at) * 1e3, 3)
            for name in LOAD_STAGES if getattr(rec, name, None) is not None}


def stage_medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The median of each of the first load's steps (:func:`load_stages`) over one arm's runs."""
    return {k: round(statistics.median(r["stages_ms"][0].get(k, float("nan")) for r in runs), 3)
            for k in runs[0]["stages_ms"][0]}


def profile_submits(rig: FormatRig, client: Any, model: Decoder, new: int, widths: list[int],
                    reps: int) -> dict[str, Any]:
    """``--profile-submit``: each engine-placement arm's ``widths`` ``reps`` more times, the engine thread's submit
    under cProfile: where the engine's thread spends the time before it can release a request."""
    import cProfile
    import io
    import pstats

    global submit_profiler
    out: dict[str, Any] = {}
    for placement in rig.workers:
        if copier_engine(rig.workers[placement]) is None:
            continue
        for width in widths:
            submit_profiler = cProfile.Profile()
            try:
                runs = [run_arm(rig, client, model, placement, width, 1, new) for _ in range(reps)]
            finally:
                prof, submit_profiler = submit_profiler, None
            stats = pstats.Stats(prof, stream=io.StringIO()).stats  # (file, line, name) -> (cc, calls, tt, ct, callers)
            top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:40]
            out[arm_name(placement, width)] = {
                "stages_ms": stage_medians(runs),
                # per load: calls, own time and time with callees in microseconds, by own time
                "profile_us_per_load": [[f"{os.path.basename(f)}:{line}({name})", round(calls / reps, 1),
                                         round(tt * 1e6 / reps, 1), round(ct * 1e6 / reps, 1)]
                                        for (f, line, name), (_, calls, tt, ct, _) in top]}
    return out


def compute_under(rig: FormatRig, model: Decoder, new: int, reps: int) -> dict[str, Any]:
    """``--interference``: the resident arm's step (one request's compute, no transfer, no layer waits), GPU time, alone
    and with one request's worth of a load's GPU work beside it on the engine-placement copier's streams:

    * ``copies``: the copy engine's host-to-device copies alone, one layer's bytes a copy from the pool into a
      scratch buffer on the copy stream, as a load's pieces are;
    * ``copies+kernels``: each layer's copy followed, on the kernel stream, by an SM pass that reads those bytes and
      writes as many elsewhere, as the scatter kernel does, the copy engine waiting for the kernel before it reuses
      one of two halves (the load's staging hand-over).

    Tells which part of a load slows the compute the engine runs beside it (the timelines' "layers computed slower").
    The bytes are not a cache's: nothing is checked, only timed."""
    e = copier_engine(rig.workers.get("engine"))
    if e is None:
        return {}
    s = model.s
    prefix = len(rig.requests[0].blocks) * s.block
    per_layer = s.kv_planes * prefix * s.kv_heads * s.head * 2
    pool_host, pool_size, _ = e._pool_range
    if pool_size < per_layer * s.layers:
        return {"skipped": f"the pool ({pool_size} bytes) is smaller than one request's {per_layer * s.layers}"}
    halves = torch.empty(2, per_layer // 4, dtype=torch.int32, device="cuda")
    out = torch.empty(per_layer // 4, dtype=torch.int32, device="cuda")
    filled = [torch.cuda.Event() for _ in range(s.layers)]
    emptied = [torch.cuda.Event() for _ in range(s.layers)]
    copy_s = e.copy_stream
    reader = rig.requests[0].reader

    def background(kind: str) -> None:
        for layer in range(s.layers):
            half = halves[layer % 2]
            if kind == "copies+kernels" and layer >= 2:
                copy_s.wait_event(emptied[layer - 2])
            rows = np.asarray([[half.data_ptr(), per_layer, pool_host + layer * per_layer, per_layer, per_layer, 1]],
                              dtype=np.int64)
            e.ext.memcpy2d_runs(rows.ctypes.data, 1, e.index, copy_s.cuda_stream)  # issued when it returns
            if kind == "copies+kernels":
                filled[layer].record(copy_s)
                e.stream.wait_event(filled[layer])
                with torch.cuda.stream(e.stream):
                    torch.bitwise_xor(half, 0, out=out)
                emptied[layer].record(e.stream)

    def step_ms() -> float:
        x = torch.randn(new, s.hidden, device="cuda", dtype=torch.bfloat16)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for layer in range(s.layers):
            x = model.layer(layer, x, [reader(layer)], new)
        model.logits(x, 1, new)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    kinds = ("alone", "copies", "copies+kernels")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    step_ms()  # warm
    for rep in range(reps):
        for kind in kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]:
            torch.cuda.synchronize()
            if kind != "alone":
                background(kind)
            times[kind].append(step_ms())
            torch.cuda.synchronize()
    result: dict[str, Any] = {k: summarize(v) for k, v in times.items()}
    alone = result["alone"]["median"]
    result["slowed_ms"] = {k: round(result[k]["median"] - alone, 3) for k in kinds[1:]}
    return result


submit_profiler: Any = None
"""``--profile-submit``: the profiler the engine thread's submits run under (None: not profiled)."""


def verify(rig: FormatRig, client: Any, model: Decoder, placement: str, width: int, truth: torch.Tensor,
           new: int) -> bool:
    """Byte-exact check of request 0's prefix after a load in this arm (run once, untimed)."""
    r = rig.requests[0]
    rig.cache.poison(r.blocks)
    run_arm(rig, client, model, placement, width, 1, new)
    exact = bool(rig.cache.read(r.blocks, 0, len(r.blocks) * model.s.block).equal(truth))
    # and the attention reads what was loaded: the format's prefix reader against the canonical bytes
    for layer in (0, model.s.layers - 1):
        for plane, read in enumerate(r.reader(layer)[:model.s.kv_planes]):
            exact &= bool(read.contiguous().view(torch.uint8).view_as(truth[plane, layer]).equal(truth[plane, layer]))
    return exact


# --- the whole run -----------------------------------------------------------------------


def summarize(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    p90 = v[min(len(v) - 1, int(round(0.9 * (len(v) - 1))))]
    return {"mean": round(statistics.fmean(v), 3), "median": round(statistics.median(v), 3), "p90": round(p90, 3),
            "min": round(v[0], 3), "max": round(v[-1], 3), "n": len(v)}


def parse_widths(text: str) -> list[int]:
    """``--widths``-style text: 0 chunk-major, N layers a slice, ``auto`` (:data:`AUTO`)."""
    return [AUTO if w == "auto" else int(w) for w in text.split(",") if w]


def warm_batch_sizes(rig: FormatRig, client: Any, model: Decoder, max_conc: int, new: int) -> list[int]:
    """Run one step of every batch size 1..``max_conc`` (resident, no transfer) before the concurrency arms, as an
    engine that has served a while has. PyTorch loads CUDA kernels lazily, on first launch, and loading one waits
    for the work queued in the process's context: the first step of a batch size whose GEMMs pick a kernel not yet
    used waited there for every copy queued behind it, in whichever arm met that batch size first (the trace is in
    ``benchmarks/README.md``, "Kernels loaded on first use")."""
    sizes = list(range(1, max_conc + 1))
    for size in sizes:
        run_arm(rig, client, model, None, None, size, new)
    return sizes


def served_one_after_another(width: int | None, serial: bool | None) -> bool:
    """Whether an arm's requests are loaded one after another (the next when the one before completed): chunk-major's
    unless ``serial`` is False (``--chunk-major-together``), a layer-major width's when ``serial`` says so
    (``--serial-widths``); None: the width's own order."""
    return width == 0 if serial is None else serial and width is not None


def arm_name(placement: str | None, width: int | None, serial: bool | None = None) -> str:
    if width is None:
        return "resident"
    name = f"{placement}/" + ("chunk" if width == 0 else "auto" if width == AUTO else f"w{width}")
    if serial:
        return name + SERIAL_SUFFIX
    return name + TOGETHER_SUFFIX if serial is False and width == 0 else name


def concurrency_arms(placements: list[str], widths: list[int], serial_widths: list[int],
                     chunk_major_together: bool = False) -> list[tuple[str | None, int | None, bool | None]]:
    """(placement, width, serial) of each arm: resident first, then every placement's widths with ``serial`` None (a
    width's own order: chunk-major's requests one after another, layer-major's together), then the layer-major
    ``serial_widths`` served one after another (True), then with ``chunk_major_together`` chunk-major's requests
    submitted together (False)."""
    return ([(None, None, None)] + [(pl, w, None) for pl in placements for w in widths]
            + [(pl, w, True) for pl in placements for w in serial_widths]
            + [(pl, 0, False) for pl in placements if chunk_major_together])


SERIAL_SUFFIX = "-serial"
"""An arm of a layer-major width whose requests are served one after another, as chunk-major's are: the next load is
submitted when the one before completed (``--serial-widths``)."""

TOGETHER_SUFFIX = "-together"
"""The chunk-major arm whose requests are all submitted at once, as layer-major's are (``--chunk-major-together``):
the queue still copies them one after another, but the next starts when the one before landed, not when the engine's
thread next polled and saw it, so the engine finds more requests ready per step."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=int, default=15104, help="cached prefix tokens per request")
    p.add_argument("--max-pool-gib", type=float, default=48.0, help="leave out concurrency levels whose prefixes "
                   "would need a larger pool (recorded as concurrency_skipped)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b", help="the model shape computed")
    p.add_argument("--new", default="256,1024,2048", help="new tokens per request, concurrency 1")
    p.add_argument("--formats", default=",".join(ENGINE_FORMATS))
    p.add_argument("--widths", default="0,1,2,4,8,auto", help="0 = chunk-major, auto = layers_per_slice: auto")
    p.add_argument("--placements", default="server,engine")
    p.add_argument("--concurrency", default="2,4,8")
    p.add_argument("--serial-widths", default="", help="at concurrency > 1, also run these layer-major widths with "
                   "the requests served one after another, as chunk-major's are (what handing the next load to the GPU "
                   "only once the one before landed would do)")
    p.add_argument("--chunk-major-together", action="store_true", help="at concurrency > 1, also run chunk-major "
                   "with every request submitted at once (the engine/chunk-together arm), the baseline of the same "
                   "submission as layer-major's")
    p.add_argument("--concurrency-new", type=int, default=256, help="new tokens per request at concurrency > 1")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--concurrency-reps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--pool-gib", type=float, default=0.0, help="the server's L1 pool, 0: sized to the run (registered for DMA by each "
                                                                "engine-placement worker: its cost is recorded)")
    p.add_argument("--stream-pad", type=int, default=0, help="diagnostic: pool streams taken before each "
                   "engine-placement arm's copier (see build_rig)")
    p.add_argument("--first-use", choices=("placements", "reversed"), default="placements",
                   help="diagnostic: the order the arms' first transfers (the byte checks) run in, which is the "
                        "order their lazily grown staging buffers and token tables are allocated in; the arms "
                        "are created in --placements order either way")
    p.add_argument("--prewarm", choices=("none", "tables", "staging", "both"), default="none",
                   help="diagnostic: allocate each engine-placement arm's token table and/or staging buffers on its "
                        "copier's kernel stream right after it registers, before any transfer")
    p.add_argument("--probe-copies", type=int, default=0, metavar="REPS",
                   help="diagnostic: after each size's runs at one request, run every engine-placement arm at "
                        "width 1 REPS more times with its copies and scatters bracketed by timing events")
    p.add_argument("--profile-submit", type=int, default=0, metavar="REPS",
                   help="diagnostic: after each size's runs at one request, run every engine-placement width REPS more "
                        "times with the engine thread's submit under cProfile (its top functions and each load "
                        "step's median time go into the JSON)")
    p.add_argument("--interference", type=int, default=0, metavar="REPS",
                   help="diagnostic: after each size's runs at one request, time the resident step REPS times alone, "
                        "beside a load's copy-engine copies, and beside those copies plus an SM pass over each layer "
                        "(compute_under in the JSON)")
    p.add_argument("--timeline-new", type=int, default=1024, metavar="N",
                   help="the one-request size whose width-1 timeline (each layer's GPU marks, engine placement and "
                        "resident) is recorded, for the first format")
    p.add_argument("--server-args", default="", help="more `kvstrata serve` arguments for the run's server (an A/B "
                   "of a server mechanism: run once with and once without, in both orders)")
    p.add_argument("--warm-batch-sizes", choices=("on", "off"), default="on",
                   help="before the concurrency arms, run one step of every batch size up to the highest "
                        "concurrency (off: each arm may be the first to launch a batch size's kernels, which PyTorch "
                        "loads on first use, waiting for everything queued on the GPU)")
    p.add_argument("--engine-loop", choices=sorted(ENGINE_LOOPS), default="sleep",
                   help="between polls the engine's thread sleeps 20 us, or spins 20 us in Python (holding the GIL)")
    p.add_argument("--out", default="benchmarks/results/ttft-h200.json")
    p.add_argument("--plot", metavar="JSON", help="only draw the PNGs from a result file (needs matplotlib)")
    p.add_argument("--evaluate", metavar="JSON", help="only recompute a result file's targets from its arms (after "
                   "this evaluation changed), writing them back")
    args = p.parse_args(argv)
    global engine_idle
    engine_idle = ENGINE_LOOPS[args.engine_loop]
    if args.plot:
        from ttft_plots import draw

        for path in draw(args.plot):
            print(path)
        return 0
    if args.evaluate:
        with open(args.evaluate) as f:
            result = json.load(f)
        result["targets"] = evaluate(result, result["config"]["placements"], result["config"]["widths"])
        write_result(result, args.evaluate)
        return 0
    widths = parse_widths(args.widths)
    if 0 not in widths:
        # found at the end of a run otherwise, when evaluating it ("evaluating FAILED: 'engine/chunk'")
        raise SystemExit("--widths must include 0: every arm is measured against chunk-major (width 0)")
    if not torch.cuda.is_available():
        print("benchmarks/ttft.py needs a CUDA device", file=sys.stderr)
        return 2
    from provenance import measured_commit

    from kvstrata.core.store.keys import CacheKey
    from kvstrata.server_process import ServerProcess
    from kvstrata.core.wire.client import CacheClient
    from kvstrata.native import cuda_ext

    s = SHAPES[args.shape]
    if args.prefix % args.chunk or args.chunk % s.block:
        raise SystemExit("--prefix must be a multiple of --chunk, and --chunk of the block size 16")
    formats, formats_skipped = [], {}
    for f in (f for f in args.formats.split(",") if f):
        try:
            formats.append(s.cache_format(f))
        except ValueError as exc:  # an engine format with no cache of this shape's kind: said in the result
            formats_skipped[f] = str(exc)
    serial_widths = parse_widths(args.serial_widths)
    if 0 in serial_widths:
        raise SystemExit("--serial-widths: chunk-major (0) is always served one request after another")
    placements = [x for x in args.placements.split(",") if x]
    built = placements if "server" in placements else ["server", *placements]  # the prefixes are stored through it
    try:
        for placement in placements:
            arm_settings(placement)
    except ValueError as exc:
        raise SystemExit(f"--placements: {exc}") from None
    news = [int(n) for n in args.new.split(",")]
    concs = [int(c) for c in args.concurrency.split(",") if c]
    request_bytes = args.prefix * s.layers * s.kv_planes * s.kv_heads * s.head * 2
    fits = max(1, int(args.max_pool_gib * (1 << 30) * 20 // 21 // request_bytes))
    skipped_concs = [c for c in concs if c > fits]  # their prefixes would not fit a pool this machine can hold
    concs = [c for c in concs if c <= fits]
    max_conc = max([1, *concs])
    # --pool-gib 0: room for every request's prefix and a margin, so no arm registers more than the run needs
    pool_bytes = int(args.pool_gib * (1 << 30)) or max_conc * request_bytes * 21 // 20 + (1 << 30)
    cuda_ext.load()
    torch.manual_seed(0)
    result: dict[str, Any] = {
        "benchmark": "ttft", "device": device_info(),
        "commit": measured_commit(),
        "config": {"engine_loop": args.engine_loop, "warm_batch_sizes": args.warm_batch_sizes, "prefix_tokens": args.prefix, "new_tokens": news, "formats": formats, "widths": widths, "serial_widths": serial_widths, "chunk_major_together": args.chunk_major_together,
                   "placements": placements, "concurrency": concs, "concurrency_new_tokens": args.concurrency_new,
                   "reps": args.reps, "concurrency_reps": args.concurrency_reps, "chunk": args.chunk,
                   "pool_gib": round(pool_bytes / (1 << 30), 2), "stream_pad": args.stream_pad, "first_use": args.first_use, "gc_collect_before_each_measurement": True,
                   "prewarm": args.prewarm, "probe_copies": args.probe_copies, "profile_submit": args.profile_submit, "interference": args.interference, "server_args": args.server_args,
                   "timeline_new_tokens": args.timeline_new,
                   "shape": args.shape, "model": s.describe(),
                   "prefix_bytes_per_request": request_bytes, "concurrency_skipped": skipped_concs,
                   "formats_skipped": formats_skipped},
        "formats": {}, "errors": {}}
    model = make_decoder(s, torch.device("cuda"))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 32000, (args.prefix,), generator=gen).tolist() for _ in range(max_conc)]
    with ServerProcess(l1_bytes=pool_bytes, chunk_size=args.chunk, log_level="WARNING",
                       extra_args=shlex.split(args.server_args)) as srv:
        client = CacheClient(srv.address, timeout=120.0)
        truth = None
        try:
            for f_index, fmt in enumerate(formats):
                t_fmt = time.perf_counter()
                rig = build_rig(fmt, client, s, prompts, args.prefix, built, args.chunk, 10 * (f_index + 1),
                                stream_pad=args.stream_pad, prewarm_what=args.prewarm)
                try:
                    fres: dict[str, Any] = {"register_s": rig.register_s, "streams": rig.streams}
                    if truth is None:  # store every request's prefix once (the server's objects are format-free)
                        storer = rig.workers["server"]
                        backend = rig.backends["server"]
                        t = time.perf_counter()
                        for r in rig.requests:
                            kv = torch.randn(s.kv_planes, s.layers, args.prefix, s.kv_heads, s.head, device="cuda",
                                             dtype=torch.bfloat16).view(torch.uint8)
                            rig.cache.write(kv, r.blocks)
                            if r.index == 0:
                                truth = kv.clone()
                            del kv
                            torch.cuda.synchronize()
                            key = CacheKey.for_tokens(f"store-{r.index}", r.prompt, model="llama")
                            reply = client.store(key, storer.instance_id, [r.blocks],
                                                 event_handle=backend.store_event_handle())
                            if reply["stored_tokens"] != args.prefix:
                                raise RuntimeError(f"stored {reply['stored_tokens']} of {args.prefix} tokens")
                        result["store_s"] = round(time.perf_counter() - t, 2)
                    else:  # fill this format's cache (the resident arm reads it), untimed
                        run_arm(rig, client, model, "server", 0, max_conc, 256)
                    first_use = placements[::-1] if args.first_use == "reversed" else placements
                    fres["verified"] = {f"{pl}/w{w}": verify(rig, client, model, pl, w, truth, 256)
                                        for pl in first_use for w in sorted({0, 1, max(widths), *({AUTO} & set(widths))})}
                    arms = concurrency_arms(placements, widths, [])
                    fres["concurrency_1"] = {}
                    for new in news:
                        run_arm(rig, client, model, placements[0], widths[0], 1, new)  # warm this size's kernels
                        runs: dict[str, list[dict]] = {arm_name(pl, w): [] for pl, w, _ in arms}
                        for rep in range(args.reps):
                            order = arms[rep % len(arms):] + arms[:rep % len(arms)]
                            for pl, w, _ in order:
                                runs[arm_name(pl, w)].append(run_arm(rig, client, model, pl, w, 1, new))
                        fres["concurrency_1"][str(new)] = {
                            name: {"ttft_ms": summarize([r["ttft_ms"][0] for r in rs]),
                                   # per repetition too: one slow repetition (a collection, say) shows as itself
                                   "ttft_ms_per_rep": [round(r["ttft_ms"][0], 3) for r in rs],
                                   **({"transfer_ms": summarize([r["transfer_ms"][0] for r in rs]),
                                       "release_ms": summarize([r["release_ms"][0] for r in rs]),
                                       "release_ms_per_rep": [round(r["release_ms"][0], 3) for r in rs]}
                                      if "transfer_ms" in rs[0] else {}),
                                   **({"last_enqueued_ms": summarize([r["last_enqueued_ms"][0] for r in rs])}
                                      if "last_enqueued_ms" in rs[0] else {}),
                                   **({"stages_ms": stage_medians(rs)} if "stages_ms" in rs[0] else {}),
                                   **({"widths": sorted({w for r in rs for w in r["widths"]})}
                                      if name.endswith("/auto") else {})}
                            for name, rs in runs.items()}
                        if args.profile_submit:
                            fres.setdefault("submit_profiles", {})[str(new)] = profile_submits(
                                rig, client, model, new, [w for w in widths if w], args.profile_submit)
                        if args.interference:
                            fres.setdefault("compute_under", {})[str(new)] = compute_under(rig, model, new,
                                                                                          args.interference)
                        if args.probe_copies:
                            fres.setdefault("probed", {})[str(new)] = probe_arms(rig, client, model, new,
                                                                                 args.probe_copies)
                        if fmt == formats[0] and new == args.timeline_new:
                            fres["timeline"] = {pl: run_arm(rig, client, model, pl, 1, 1, new, timeline=True)
                                                for pl in placements if pl in ("server", "engine")}
                            fres["timeline"]["resident"] = run_arm(rig, client, model, None, None, 1, new,
                                                                   timeline=True)
                    fres["concurrency"] = {}
                    if concs and args.warm_batch_sizes == "on":
                        fres["batch_sizes_warmed"] = warm_batch_sizes(rig, client, model, max(concs),
                                                                      args.concurrency_new)
                    conc_arms = concurrency_arms(placements, widths, serial_widths, args.chunk_major_together)
                    for conc in concs:
                        runs = {arm_name(*arm): [] for arm in conc_arms}
                        for rep in range(args.concurrency_reps):
                            order = conc_arms[rep % len(conc_arms):] + conc_arms[:rep % len(conc_arms)]
                            for pl, w, serial in order:
                                runs[arm_name(pl, w, serial)].append(run_arm(rig, client, model, pl, w, conc,
                                                                             args.concurrency_new, serial=serial))
                        fres["concurrency"][str(conc)] = {
                            name: {"ttft_ms": summarize([t for r in rs for t in r["ttft_ms"]]),
                                   "mean_ttft_ms_per_rep": [round(statistics.fmean(r["ttft_ms"]), 3) for r in rs],
                                   # how the engine batched the released requests, per rep: (requests, start, end)
                                   "steps_per_rep": [[(st["requests"], round(st["start_ms"], 2), round(st["end_ms"], 2))
                                                      for st in r["steps"]] for r in rs],
                                   **({"release_ms_per_rep": [[round(t, 2) for t in r["release_ms"]] for r in rs],
                                       "transfer_ms_per_rep": [[round(t, 2) for t in r["transfer_ms"]] for r in rs],
                                       # each load's submit, then its steps after it (load_stages): planned late or
                                       # landed late
                                       "submitted_ms_per_rep": [[round(t, 2) for t in r["submitted_ms"]] for r in rs],
                                       "stages_ms_per_rep": [r["stages_ms"] for r in rs]}
                                      if "release_ms" in rs[0] else {})}
                            for name, rs in runs.items()}
                    note_copiers(rig)
                    fres["elapsed_s"] = round(time.perf_counter() - t_fmt, 1)
                    result["formats"][fmt] = fres
                except Exception as exc:
                    result["errors"][fmt] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
                    print(f"[{fmt}] FAILED: {exc}", file=sys.stderr)
                    traceback.print_exc(file=sys.stderr)
                finally:
                    try:
                        close_rig(rig)
                    except Exception as exc:  # a CUDA error is sticky: the formats after it fail too, but say so
                        result["errors"][f"{fmt}/close"] = f"{type(exc).__name__}: {exc}"
                        print(f"[{fmt}] closing FAILED: {exc}", file=sys.stderr)
                    write_result(result, args.out)  # what ran so far, before freeing (a sticky error can abort there)
                    del rig
                    gc.collect()
                    torch.cuda.empty_cache()
                    # what the next format starts with: the model's weights, unless a format's memory outlived it
                    result.setdefault("gpu_gib_after_format", {})[fmt] = round(torch.cuda.memory_allocated() / 2**30, 2)
                print(f"[{fmt}] {time.perf_counter() - t_fmt:.1f} s", file=sys.stderr, flush=True)
        finally:
            client.close()
    try:
        result["targets"] = evaluate(result, placements, widths)
    except Exception as exc:  # e.g. no chunk-major arm to judge against: the measurements are still written
        result["errors"]["evaluate"] = f"{type(exc).__name__}: {exc}"
        print(f"evaluating FAILED: {exc}", file=sys.stderr)
    write_result(result, args.out)
    print(json.dumps(result.get("targets"), indent=1))
    return 0 if not result["errors"] else 1


def write_result(result: dict[str, Any], path: str) -> None:
    """Write the run's JSON (replacing the file whole): after each format, so that a run stopped later keeps
    what it measured, and at the end with the targets."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


def evaluate(result: dict[str, Any], placements: list[str], widths: list[int]) -> dict[str, Any]:
    """The first-token targets, per format and placement, from this run's own arms."""
    out: dict[str, Any] = {}
    layer_widths = [w for w in widths if w > 0]  # the fixed widths (auto is judged against the best of them)
    for fmt, fres in result["formats"].items():
        for pl in placements:
            rows = {}
            for new, arms in fres.get("concurrency_1", {}).items():
                compute = arms["resident"]["ttft_ms"]["median"]
                chunk = arms[f"{pl}/chunk"]
                transfer = chunk["transfer_ms"]["median"]
                base = chunk["ttft_ms"]["median"]
                ceiling = min(transfer, compute) / (transfer + compute)
                best_w = min(layer_widths, key=lambda w: arms[f"{pl}/w{w}"]["ttft_ms"]["median"])
                best = arms[f"{pl}/w{best_w}"]["ttft_ms"]["median"]
                gain = 1 - best / base
                rows[new] = {"compute_ms": compute, "transfer_ms": transfer, "chunk_major_ttft_ms": base,
                             "best_width": best_w, "best_ttft_ms": best, "gain": round(gain, 4),
                             "ceiling": round(ceiling, 4), "fraction_of_ceiling": round(gain / ceiling, 3),
                             "met_85pct": gain >= 0.85 * ceiling}
                if f"{pl}/auto" in arms:
                    auto = arms[f"{pl}/auto"]
                    rows[new].update(auto_ttft_ms=auto["ttft_ms"]["median"], auto_widths=auto.get("widths"),
                                     auto_vs_best_fixed=round(auto["ttft_ms"]["median"] / min(best, base) - 1, 4),
                                     auto_fraction_of_ceiling=round((1 - auto["ttft_ms"]["median"] / base) / ceiling,
                                                                    3))
            conc_rows = {}
            for conc, arms in fres.get("concurrency", {}).items():
                chunk = arms[f"{pl}/chunk"]["ttft_ms"]
                best_w = min(layer_widths, key=lambda w: arms[f"{pl}/w{w}"]["ttft_ms"]["mean"])
                best = arms[f"{pl}/w{best_w}"]["ttft_ms"]
                resident = arms["resident"]["ttft_ms"]
                conc_rows[conc] = {"chunk_major_mean_ms": chunk["mean"], "chunk_major_p90_ms": chunk["p90"],
                                   "best_width": best_w, "mean_ms": best["mean"], "p90_ms": best["p90"],
                                   "mean_change": round(best["mean"] / chunk["mean"] - 1, 4),
                                   "never_worse": best["mean"] <= chunk["mean"] and best["p90"] <= chunk["p90"],
                                   # no transfer at all (every prefix resident, every request in the first step):
                                   # where even that is worse than chunk-major, what costs the mean is how the
                                   # engine batches the requests it has, not how fast they arrive
                                   "resident_mean_ms": resident["mean"],
                                   "resident_mean_change": round(resident["mean"] / chunk["mean"] - 1, 4)}
                serial = [n for n in arms if n.startswith(f"{pl}/") and n.endswith(SERIAL_SUFFIX)]
                if serial:  # layer-major served one request after another
                    name = min(serial, key=lambda n: arms[n]["ttft_ms"]["mean"])
                    best_serial = arms[name]["ttft_ms"]
                    conc_rows[conc].update(
                        serial_best=name.split("/", 1)[1], serial_mean_ms=best_serial["mean"],
                        serial_p90_ms=best_serial["p90"], serial_mean_change=round(best_serial["mean"] / chunk["mean"] - 1, 4),
                        serial_never_worse=best_serial["mean"] <= chunk["mean"] and best_serial["p90"] <= chunk["p90"])
                together = arms.get(f"{pl}/chunk{TOGETHER_SUFFIX}")
                if together:  # the same submission as layer-major's: every request at once
                    t = together["ttft_ms"]
                    conc_rows[conc].update(
                        together_mean_ms=t["mean"], together_p90_ms=t["p90"],
                        together_mean_change=round(t["mean"] / chunk["mean"] - 1, 4),
                        best_vs_together_mean_change=round(best["mean"] / t["mean"] - 1, 4),
                        never_worse_than_together=best["mean"] <= t["mean"] and best["p90"] <= t["p90"])
                if f"{pl}/auto" in arms:
                    auto = arms[f"{pl}/auto"]["ttft_ms"]
                    conc_rows[conc].update(auto_mean_ms=auto["mean"], auto_p90_ms=auto["p90"],
                                           auto_mean_change=round(auto["mean"] / chunk["mean"] - 1, 4),
                                           auto_never_worse=auto["mean"] <= chunk["mean"] and auto["p90"] <= chunk["p90"])
            out[f"{fmt}/{pl}"] = {"concurrency_1": rows, "concurrency": conc_rows}
    return out


if __name__ == "__main__":
    sys.exit(main())
