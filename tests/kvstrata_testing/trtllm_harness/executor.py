"""TensorRT-LLM 1.2's connector manager and executor loop, in its per-iteration order, around the tiny model.

Written from TensorRT-LLM's sources at ``standin.SOURCE`` (no code copied); each class names what it
follows. One iteration of ``PyExecutor._executor_loop`` (py_executor.py), as the connector sees it:

1. schedule (``GUARANTEED_NO_EVICT``: a request is admitted only if blocks for its whole prompt and every
   token it may generate are free);
2. ``KVCacheManager.prepare_resources`` (resource_manager.py): for a context request's first chunk only,
   add the sequence (allocate its blocks), ask ``get_num_new_matched_tokens`` (rank 0, broadcast), advance
   its context position by the match, then ``update_state_after_alloc(req, block ids)``; then
   ``build_scheduler_output``;
3. ``PyExecutor._kv_connector_start_batch``: ``take_scheduled_requests_pending_load`` (asynchronous matches
   leave the batch), ``handle_metadata`` (``build_connector_meta`` on rank 0 every iteration, pickled to
   every rank, ``bind_connector_meta``), ``start_load_kv(current stream)`` on every rank;
4. ``PyExecutor._forward_step``: the model forward (the ``DecoderLayer`` pre-hook calls
   ``wait_for_layer_load``, the post-hook ``save_kv_layer``), then ``wait_for_save``; an exception there
   fails the batch's requests (``_handle_errors``);
5. sample, update the requests, ``_handle_canceled_requests``, ``_handle_responses`` (a finished or
   cancelled request goes to ``request_finished`` on rank 0: True holds its blocks);
6. ``_kv_connector_terminate_requests``: ``get_finished`` on every rank, all-gathered, intersected; held
   requests every rank reported saved are freed, loaded ones go back to the context state.

With ``overlap=True`` the order is ``_executor_loop_overlap``'s: iteration N+1 is scheduled, its loads
started and its forward run before iteration N's sampled tokens are applied to the requests.

The connector manager's steps above are ``KvCacheConnectorManager``'s methods in
``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py`` at ``standin.SOURCE``: ``get_num_new_matched_tokens``
412-436, ``update_state_after_alloc`` 560-562, ``build_scheduler_output`` 442-445 (which calls
``KvCacheConnectorSchedulerOutputManager.build_scheduler_output``, 325-357),
``take_scheduled_requests_pending_load`` 447-473, ``handle_metadata`` 475-481, ``request_finished`` 483-507,
``get_finished`` 509-558, ``layer_pre_hook`` / ``layer_post_hook`` 567-572.
"""

from __future__ import annotations

import enum
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import standin
from .model import Segment, TinyConfig, TinyTPModel


class LlmRequestState(enum.Enum):
    """Follows ``tensorrt_llm.bindings.LlmRequestState`` (the states the connector manager sets)."""

    CONTEXT_INIT = 1
    GENERATION_IN_PROGRESS = 2
    GENERATION_COMPLETE = 3
    DISAGG_GENERATION_TRANS_IN_PROGRESS = 4
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = 5


class LlmRequest:
    """Follows the parts of ``tensorrt_llm.bindings.internal.batch_manager.LlmRequest`` the connector and the
    manager read: ``request_id``, ``get_tokens(beam)``, ``state``, the context position and chunk size."""

    def __init__(self, request_id: int, prompt: list[int], max_new_tokens: int, chunk_size: int) -> None:
        self.request_id = self.py_request_id = request_id
        self.prompt_len = len(prompt)
        self.tokens = list(prompt)
        self.max_new_tokens = max_new_tokens
        self.state = LlmRequestState.CONTEXT_INIT
        self.context_current_position = 0
        self.context_chunk_size = chunk_size
        self.is_generation_only_request = False
        self.logits: list[torch.Tensor] = []
        self.error: str | None = None
        self.cancelled = False
        self.sequence_added = False

    def get_tokens(self, beam: int) -> list[int]:
        return list(self.tokens)

    @property
    def context_remaining_length(self) -> int:
        return self.prompt_len - self.context_current_position

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class KVCacheManager:
    """Follows ``KVCacheManager`` (tensorrt_llm/_torch/pyexecutor/resource_manager.py:151-1154, lines at commit
    d2a5560abdadfbdf496ce057696103e0509a71ed, as SOURCE's copy of that file is not stored; ``prepare_resources``
    400-440, ``get_unique_primary_pool`` 820-821) as the connector sees it: one primary pool per rank,
    ``[num_blocks, num_layers, 2, block_size_elems]``, the same block ids on every rank."""

    def __init__(self, cfg: TinyConfig, num_blocks: int, pools: list[torch.Tensor]) -> None:
        self.cfg, self.num_blocks, self.pools = cfg, num_blocks, pools
        self._free = list(range(num_blocks))
        self.blocks: dict[int, list[int]] = {}

    def get_unique_primary_pool(self, rank: int) -> torch.Tensor:
        return self.pools[rank]

    def get_cache_indices(self, req: LlmRequest) -> list[int]:
        return list(self.blocks.get(req.request_id, []))

    def blocks_needed(self, req: LlmRequest) -> int:
        return -(-(req.prompt_len + req.max_new_tokens + 1) // self.cfg.tokens_per_block)

    def can_admit(self, req: LlmRequest) -> bool:
        return self.blocks_needed(req) <= len(self._free)

    def add_sequence(self, req: LlmRequest) -> None:
        """GUARANTEED_NO_EVICT: every block the request can ever need, now."""
        n = self.blocks_needed(req)
        self.blocks[req.request_id], self._free = self._free[:n], self._free[n:]

    def free_resources(self, req: LlmRequest) -> None:
        self._free.extend(self.blocks.pop(req.request_id, []))

    @property
    def free_blocks(self) -> int:
        return len(self._free)


@dataclass
class _AsyncRequests:
    """Follows ``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py:239-286 (AsyncRequests)``: requests
    saving / loading asynchronously."""

    saving: dict[int, LlmRequest] = field(default_factory=dict)
    loading: dict[int, LlmRequest] = field(default_factory=dict)

    def add_from(self, other: _AsyncRequests) -> None:
        self.saving.update(other.saving)
        self.loading.update(other.loading)
        other.saving, other.loading = {}, {}

    def extract_by_id(self, saving_ids: list[int], loading_ids: list[int]) -> _AsyncRequests:
        # TensorRT-LLM indexes these dicts directly: an id a worker returns that it was never given is a KeyError.
        out = _AsyncRequests()
        for rid in saving_ids:
            out.saving[rid] = self.saving.pop(rid)
        for rid in loading_ids:
            out.loading[rid] = self.loading.pop(rid)
        return out


class _RequestTracker:
    """Follows ``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py:289-316
    (KvCacheConnectorSchedulerOutputRequest)``."""

    def __init__(self) -> None:
        self.block_ids: list[int] = []
        self.tokens: list[int] = []

    def update_and_build_data(self, req: LlmRequest, kv: KVCacheManager) -> standin.RequestData:
        block_ids, tokens = kv.get_cache_indices(req), req.get_tokens(0)
        new_blocks, new_tokens = block_ids[len(self.block_ids):], tokens[len(self.tokens):]
        self.block_ids.extend(new_blocks)
        self.tokens.extend(new_tokens)
        if req.state in (LlmRequestState.CONTEXT_INIT, LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS):
            computed = req.context_current_position
            scheduled = min(req.context_remaining_length, req.context_chunk_size)
        else:
            computed, scheduled = len(tokens) - 1, 1
        return standin.RequestData(req.request_id, new_tokens, new_blocks, computed, scheduled)


class ConnectorManager:
    """Follows ``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py:364-572 (KvCacheConnectorManager)``,
    with every rank in this one process; its ``build_scheduler_output`` also does the work of
    ``KvCacheConnectorSchedulerOutputManager`` (same file, 319-361).

    Rank 0's scheduler answers are broadcast by pickling (TensorRT-LLM's ``mpi_broadcast``: its own ranks'
    channel, never kvstrata's wire); ``get_finished`` is all-gathered and intersected, each rank keeping its
    own pending and locally-finished requests as each rank's manager does.
    """

    def __init__(self, workers: list[Any], scheduler: Any) -> None:
        self.workers, self.scheduler = workers, scheduler
        self.world = len(workers)
        self.new_async = _AsyncRequests()
        self.pending = [_AsyncRequests() for _ in workers]
        self.local_finished = [_AsyncRequests() for _ in workers]
        self.finished_async_loading: dict[int, LlmRequest] = {}
        self.trackers: dict[int, _RequestTracker] = {}
        self.external_loads: dict[int, int] = {}
        self.scheduler_output: standin.SchedulerOutput | None = None
        self.broadcasts: list[bytes] = []
        """Every pickled broadcast (tests check the metadata really crossed as bytes)."""

    def _run_on_leader(self, f: Callable[[], Any]) -> list[Any]:
        standin.set_rank(0)
        blob = pickle.dumps(f())
        self.broadcasts.append(blob)
        return [pickle.loads(blob) for _ in range(self.world)]

    def get_num_new_matched_tokens(self, req: LlmRequest, num_computed_tokens: int) -> int:
        if req.is_generation_only_request:
            raise RuntimeError("Connector API is not supported for generation-only requests!")
        num_tokens, load_async = self._run_on_leader(
            lambda: self.scheduler.get_num_new_matched_tokens(req, num_computed_tokens))[0]
        if num_tokens == 0 and load_async:
            raise RuntimeError("load_kv_async must be False when num_tokens is 0!")
        if load_async:
            self.new_async.loading[req.request_id] = req
        self.external_loads[req.request_id] = num_tokens
        return num_tokens

    def should_add_sequence(self, req: LlmRequest) -> bool:
        return req.request_id not in self.finished_async_loading

    def update_state_after_alloc(self, req: LlmRequest, block_ids: list[int]) -> None:
        standin.set_rank(0)
        self.scheduler.update_state_after_alloc(req, block_ids)

    def build_scheduler_output(self, context: list[LlmRequest], generation: list[LlmRequest],
                               kv: KVCacheManager) -> None:
        out = standin.SchedulerOutput()
        for req in context:
            if req.request_id in self.new_async.loading:
                continue
            is_new = req.request_id not in self.trackers
            data = self.trackers.setdefault(req.request_id, _RequestTracker()).update_and_build_data(req, kv)
            if req.request_id in self.external_loads:
                data.computed_position -= self.external_loads[req.request_id]
            (out.new_requests if is_new else out.cached_requests).append(data)
        for req in generation:
            out.cached_requests.append(self.trackers.setdefault(req.request_id, _RequestTracker())
                                       .update_and_build_data(req, kv))
        self.external_loads = {}
        self.scheduler_output = out

    def take_scheduled_requests_pending_load(self, context: list[LlmRequest]) -> list[LlmRequest]:
        allowed = []
        for req in context:
            if req.request_id in self.new_async.loading:
                req.state = LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS
                self.new_async.loading[req.request_id] = req
            else:
                allowed.append(req)
        return allowed

    def handle_metadata(self) -> None:
        output = self.scheduler_output
        metas = self._run_on_leader(lambda: self.scheduler.build_connector_meta(output))
        self.scheduler_output = None
        for rank, (worker, meta) in enumerate(zip(self.workers, metas)):
            standin.set_rank(rank)
            worker.bind_connector_meta(meta)

    def request_finished(self, req: LlmRequest, block_ids: list[int]) -> bool:
        self.finished_async_loading.pop(req.request_id, None)
        saving = self._run_on_leader(lambda: self.scheduler.request_finished(req, block_ids))[0]
        if saving:
            self.new_async.saving[req.request_id] = req
            req.state = LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS
        return saving

    def get_finished(self) -> list[LlmRequest]:
        started_loading = list(self.new_async.loading)
        finished_gen = list(self.new_async.saving)
        gathered = []
        for rank, worker in enumerate(self.workers):
            standin.set_rank(rank)
            self.pending[rank].saving.update(self.new_async.saving)
            self.pending[rank].loading.update(self.new_async.loading)
            saved, loaded = worker.get_finished(list(finished_gen), list(started_loading))
            self.local_finished[rank].add_from(self.pending[rank].extract_by_id(saved, loaded))
            gathered.append((set(self.local_finished[rank].saving), set(self.local_finished[rank].loading)))
        self.new_async = _AsyncRequests()
        all_saved = set.intersection(*[g[0] for g in gathered])
        all_loaded = set.intersection(*[g[1] for g in gathered])
        done = None
        for rank in range(self.world):
            got = self.local_finished[rank].extract_by_id(list(all_saved), list(all_loaded))
            done = done or got
        for rid, req in done.loading.items():
            req.state = LlmRequestState.CONTEXT_INIT
            self.finished_async_loading[rid] = req
        return list(done.saving.values())

    def layer_pre_hook(self, rank: int) -> Callable:
        worker = self.workers[rank]

        def hook(module: Any, *args: Any) -> None:
            worker.wait_for_layer_load(module.layer_idx, _current_stream(module))
        return hook

    def layer_post_hook(self, rank: int) -> Callable:
        worker = self.workers[rank]

        def hook(module: Any, *args: Any) -> None:
            worker.save_kv_layer(module.layer_idx, _current_stream(module))
        return hook


def _current_stream(module: Any) -> Any:
    """TensorRT-LLM passes ``torch.cuda.current_stream()``; on CPU there is no stream (None)."""
    pool = getattr(module, "pool", None)
    return torch.cuda.current_stream() if pool is not None and pool.is_cuda else None


@dataclass
class Connector:
    """The three strings of ``KvCacheConnectorConfig``, resolved as TensorRT-LLM's ``create_py_executor`` does."""

    config: standin.KvCacheConnectorConfig

    def build(self, llm_args: standin.TorchLlmArgs, world: int) -> tuple[list[Any], Any]:
        import importlib

        module = importlib.import_module(self.config.connector_module)
        worker_cls = getattr(module, self.config.connector_worker_class)
        scheduler_cls = getattr(module, self.config.connector_scheduler_class)
        workers = []
        for rank in range(world):
            standin.set_rank(rank)
            workers.append(worker_cls(llm_args))
        standin.set_rank(0)
        return workers, scheduler_cls(llm_args)


class Executor:
    """Follows ``PyExecutor`` (py_executor.py): ``_executor_loop`` or ``_executor_loop_overlap``, the loops'
    calls into the connector manager in their order, on the tiny model over ``world`` ranks."""

    def __init__(self, cfg: TinyConfig, *, world: int = 1, num_blocks: int = 64, chunk_size: int = 1 << 30,
                 connector: standin.KvCacheConnectorConfig | None = None, overlap: bool = False,
                 device: str = "cpu", pools: list[torch.Tensor] | None = None, stream: Any = None,
                 warmup: Callable[[Executor], None] | None = None) -> None:
        self.cfg, self.world, self.chunk_size, self.overlap, self.device = cfg, world, chunk_size, overlap, device
        self.model = TinyTPModel(cfg, world, device)
        shape = (num_blocks, cfg.num_layers, 2, cfg.block_size_elems // world)
        self.pools = pools or [torch.zeros(shape, dtype=torch.float32, device=device) for _ in range(world)]
        for p in self.pools:
            if tuple(p.shape) != shape:
                raise ValueError(f"pool shape {tuple(p.shape)}, expected {shape}")
        for r, rank_model in enumerate(self.model.ranks):
            rank_model.bind_pool(self.pools[r])
        self.kv = KVCacheManager(cfg, num_blocks, self.pools)
        self.stream = stream
        self.llm_args = standin.TorchLlmArgs(model="kvstrata-trtllm-harness", tensor_parallel_size=world,
                                             kv_cache_config=standin.KvCacheConfig(cfg.tokens_per_block),
                                             kv_connector_config=connector)
        self.waiting: list[LlmRequest] = []
        self.active: list[LlmRequest] = []
        self.held: dict[int, LlmRequest] = {}
        """Finished requests whose blocks the connector holds (request_finished returned True)."""
        self.done: dict[int, LlmRequest] = {}
        self.iterations = 0
        self._previous: tuple[list[LlmRequest], dict[int, int]] | None = None
        self.decode_graph: Any = None
        """Set by ``warmup`` (the GPU test): ``replay(token, segment) -> logits [1, vocab]`` for one decode."""
        if warmup is not None:
            warmup(self)  # before the connector's hooks exist, as TensorRT-LLM warms up (and captures graphs)
        self.manager: ConnectorManager | None = None
        if connector is not None:
            workers, scheduler = Connector(connector).build(self.llm_args, world)
            self.manager = ConnectorManager(workers, scheduler)
            for r, worker in enumerate(workers):
                standin.set_rank(r)
                worker.register_kv_caches(self.kv.get_unique_primary_pool(r))
                for module in self.model.ranks[r].modules():
                    if isinstance(module, self._decoder_layer_class()):
                        module.register_forward_pre_hook(self.manager.layer_pre_hook(r))
                        module.register_forward_hook(self.manager.layer_post_hook(r))

    @staticmethod
    def _decoder_layer_class() -> type:
        from .model import DecoderLayer

        return DecoderLayer

    # --- requests ------------------------------------------------------------------------

    def add_request(self, request_id: int, prompt: list[int], max_new_tokens: int) -> LlmRequest:
        req = LlmRequest(request_id, prompt, max_new_tokens, self.chunk_size)
        self.waiting.append(req)
        return req

    def abort(self, request_id: int) -> None:
        for req in self.waiting + self.active:
            if req.request_id == request_id:
                req.cancelled = True

    # --- one iteration ---------------------------------------------------------------------

    def _schedule(self) -> tuple[list[LlmRequest], list[LlmRequest]]:
        for req in list(self.waiting):
            if self.kv.can_admit(req):
                self.waiting.remove(req)
                self.active.append(req)
        context = [r for r in self.active if r.state == LlmRequestState.CONTEXT_INIT and not r.cancelled]
        generation = [r for r in self.active if r.state == LlmRequestState.GENERATION_IN_PROGRESS and not r.cancelled]
        return context, generation

    def _prepare_resources(self, context: list[LlmRequest], generation: list[LlmRequest]) -> None:
        m = self.manager
        for req in context:
            if req.sequence_added:
                continue
            req.sequence_added = True
            if m is not None and not m.should_add_sequence(req):
                continue  # loaded asynchronously: its blocks and match are already there
            self.kv.add_sequence(req)
            if m is not None:
                # kvstrata's stand-in engine has no prefix reuse of its own: num_computed_tokens is 0
                req.context_current_position += m.get_num_new_matched_tokens(req, 0)
                m.update_state_after_alloc(req, self.kv.get_cache_indices(req))
        if m is not None:
            m.build_scheduler_output(context, generation, self.kv)

    def _start_batch(self, context: list[LlmRequest]) -> list[LlmRequest]:
        m = self.manager
        if m is None:
            return context
        context = m.take_scheduled_requests_pending_load(context)
        m.handle_metadata()
        for rank, worker in enumerate(m.workers):
            standin.set_rank(rank)
            worker.start_load_kv(self._current_stream())
        return context

    def _current_stream(self) -> Any:
        return torch.cuda.current_stream() if self.device != "cpu" else None

    def _forward_step(self, context: list[LlmRequest], generation: list[LlmRequest],
                      pending: dict[int, int]) -> dict[int, int] | None:
        """The forward and ``wait_for_save``; an exception fails the batch (``_handle_errors``). Returns the
        tokens sampled for each request (applied to the requests by ``_update_requests``)."""
        batch = context + generation
        if not batch:
            return {}
        try:
            tokens, segments, last, ends = [], [], [], []
            for req in context:
                end = min(req.prompt_len, req.context_current_position + req.context_chunk_size)
                tokens += req.tokens[req.context_current_position:end]
                segments.append(self._segment(req, req.context_current_position, end))
                last.append(len(tokens) - 1)
                ends.append(end)
            for req in generation:
                pos = len(req.tokens) - (0 if req.request_id in pending else 1)
                tokens.append(pending.get(req.request_id, req.tokens[-1]))
                segments.append(self._segment(req, pos, pos + 1))
                last.append(len(tokens) - 1)
                ends.append(pos + 1)
            if not context and self.decode_graph is not None:
                # a decode-only batch replays the CUDA graph captured at warm-up: no Python runs per layer,
                # so no connector hook fires (as in TensorRT-LLM)
                logits = torch.cat([self.decode_graph.replay(tokens[j], seg) for j, seg in enumerate(segments)])
            else:
                ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
                logits = self.model.forward(ids, segments, on_rank=standin.set_rank)
            if self.manager is not None:
                for rank, worker in enumerate(self.manager.workers):
                    standin.set_rank(rank)
                    worker.wait_for_save(self._current_stream())
        except Exception as exc:  # noqa: BLE001 - PyExecutor._forward_step catches every exception
            self._handle_errors(batch, f"{type(exc).__name__}: {exc}")
            return None
        sampled = {}
        for req, end, i in zip(batch, ends, last):
            if req.state == LlmRequestState.CONTEXT_INIT:
                req.context_current_position = end
                if end < req.prompt_len:
                    continue  # a middle chunk samples nothing
                req.state = LlmRequestState.GENERATION_IN_PROGRESS  # _update_request_states
            req.logits.append(logits[i].detach().to("cpu").clone())
            sampled[req.request_id] = int(torch.argmax(logits[i]))
        return sampled

    def _segment(self, req: LlmRequest, start: int, end: int) -> Segment:
        return Segment(torch.arange(start, end, device=self.device), self._table(req, end))

    def _table(self, req: LlmRequest, end: int) -> torch.Tensor:
        cfg = self.cfg
        if end > cfg.max_ctx:
            raise ValueError(f"request {req.request_id}: {end} positions exceed the model's max_ctx {cfg.max_ctx}")
        blocks = self.kv.get_cache_indices(req)
        width = cfg.max_ctx // cfg.tokens_per_block
        return torch.tensor((blocks + [blocks[0]] * width)[:width], dtype=torch.int64, device=self.device)

    def _handle_errors(self, batch: list[LlmRequest], message: str) -> None:
        for req in batch:
            req.error = message
            req.state = LlmRequestState.GENERATION_COMPLETE

    def _update_requests(self, batch: list[LlmRequest], sampled: dict[int, int]) -> None:
        for req in batch:
            if req.request_id not in sampled or req.state == LlmRequestState.GENERATION_COMPLETE:
                continue
            if len(req.generated) >= req.max_new_tokens:
                continue  # the overlap loop ran one iteration past the end: its token is dropped
            req.tokens.append(sampled[req.request_id])
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
            if len(req.generated) >= req.max_new_tokens:
                req.state = LlmRequestState.GENERATION_COMPLETE

    def _terminate(self, req: LlmRequest) -> None:
        """``PyExecutor._terminate_request``: the connector may hold the blocks."""
        self.active.remove(req)
        m = self.manager
        if m is not None and req.sequence_added and \
                m.request_finished(req, self.kv.get_cache_indices(req)):
            self.held[req.request_id] = req
        else:
            self.kv.free_resources(req)
        self.done[req.request_id] = req

    def _handle_responses(self) -> None:
        for req in list(self.active):
            if req.cancelled and req.error is None:
                req.error = "cancelled"
            if req.cancelled or req.state == LlmRequestState.GENERATION_COMPLETE:
                self._terminate(req)

    def _kv_connector_terminate_requests(self) -> None:
        if self.manager is None:
            return
        for req in self.manager.get_finished():
            self.held.pop(req.request_id, None)
            self.kv.free_resources(req)

    def step(self) -> None:
        """One iteration of the executor loop."""
        self.iterations += 1
        context, generation = self._schedule()
        if context or generation:
            self._prepare_resources(context, generation)
            context = self._start_batch(context)
        if not self.overlap:
            sampled = self._forward_step(context, generation, {})
            if sampled is not None:
                self._update_requests(context + generation, sampled)
        else:
            previous = self._previous
            pending = previous[1] if previous else {}
            sampled = self._forward_step(context, generation, pending)
            if previous is not None:
                self._update_requests(*previous)
            self._previous = (context + generation, sampled) if sampled else None
        self._handle_responses()
        self._kv_connector_terminate_requests()

    def idle(self) -> bool:
        return not self.waiting and not self.active and not self.held and self._previous is None

    def run(self, timeout: float = 120.0) -> dict[int, LlmRequest]:
        """Iterate until every request finished and no blocks are held. ``timeout`` only catches a hang: an
        iteration with nothing to compute sleeps a millisecond, as blocks held by a transfer wait for it."""
        deadline = time.monotonic() + timeout
        while not self.idle():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the executor did not go idle within {timeout:.0f}s: waiting "
                                   f"{[r.request_id for r in self.waiting]}, active "
                                   f"{[r.request_id for r in self.active]}, held {sorted(self.held)}")
            busy = bool(self.waiting or self.active)
            self.step()
            if not busy:
                time.sleep(0.001)
        return self.done

    def shutdown(self) -> None:
        if self.manager is not None:
            for rank, worker in enumerate(self.manager.workers):
                standin.set_rank(rank)
                worker.shutdown()
            self.manager.scheduler.shutdown()
