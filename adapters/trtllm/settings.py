"""kvstrata's settings for TensorRT-LLM, which passes a connector no settings of its own.

``KvCacheConnectorConfig`` is three strings (module, scheduler class, worker class), so the settings come
from the environment of the TensorRT-LLM processes (every rank inherits it):

* ``KVSTRATA_TRTLLM_CONFIG``: a JSON object inline (it starts with ``{``) or the path of a JSON or YAML
  file holding one.

The object holds :class:`~kvstrata.core.engine.settings.RuntimeSettings` keys and this adapter's own
keys ``async_load`` (default false) and ``kv_heads`` (default 0, see :class:`TrtllmOptions`). An unknown key, a
bad value, an unreadable file or a variable that is neither JSON nor a path is an error naming the variable (and
file) and what was wrong.

``instance_id``: set it when two TensorRT-LLM engines share a server (each rank registers ``instance_id +
rank``, and both sides' lock owners embed it). TensorRT-LLM hands a connector only its ``llm_args``, the
engine's configuration (two engines started alike have equal ones), so unlike vLLM's adapter this one has
nothing to derive a per-engine default from: it stays 0, and the second engine's registration is refused; its
workers log the server's reason ("instance N is registered by another connection ...") and compute every
prompt until the id is free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstrata.core.engine.settings import RuntimeSettings

ENV_VAR = "KVSTRATA_TRTLLM_CONFIG"


@dataclass(frozen=True)
class TrtllmOptions:
    """What only this adapter reads."""

    async_load: bool = False
    """False (default): a hit is matched synchronously, ``(n, False)``: the request runs in the step its load
    starts and each layer's wait orders the forward after that layer's copy. True: ``(n, True)``: TensorRT-LLM
    parks the request until every rank reports it in ``get_finished``, which kvstrata does once its first
    slice has landed."""

    kv_heads: int = 0
    """KV heads per rank in the pool (the model's ``num_key_value_heads`` / tensor-parallel size). TensorRT-LLM's
    pool does not say how a block splits into heads: with this kvstrata addresses it per token (HND in a block),
    so its chunks are the same bytes SGLang and vLLM on CUDA store for the same model and dtype, and each reads
    the others'. 0 (default): blocks move as opaque pages, shared with TensorRT-LLM engines alone."""

    KEYS = ("async_load", "kv_heads")


def parse(values: Mapping[str, Any], where: str) -> tuple[RuntimeSettings, TrtllmOptions]:
    """The runtime's settings and this adapter's options from one mapping (errors name ``where``)."""
    # Every settings error is a ValueError naming where it was written, as RuntimeSettings.from_mapping's.
    if not isinstance(values, Mapping):
        raise ValueError(f"{where}: expected a JSON object of kvstrata settings, got {type(values).__name__}")  # noqa: TRY004
    runtime = {k: v for k, v in values.items() if k not in TrtllmOptions.KEYS}
    async_load = values.get("async_load", False)
    if not isinstance(async_load, bool):
        raise ValueError(f"{where}.async_load must be true or false, got {async_load!r}")  # noqa: TRY004
    kv_heads = values.get("kv_heads", 0)
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 0:
        raise ValueError(f"{where}.kv_heads must be a whole number of KV heads per rank (0: opaque pages), "
                         f"got {kv_heads!r}")
    return RuntimeSettings.from_mapping(runtime, where=where), TrtllmOptions(async_load=async_load,
                                                                             kv_heads=kv_heads)


def load(environ: Mapping[str, str] | None = None) -> tuple[RuntimeSettings, TrtllmOptions]:
    """The settings for this process, from :data:`ENV_VAR` (unset: every default)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_VAR, "").strip()
    if not raw:
        return parse({}, ENV_VAR)
    if raw.startswith("{"):
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{ENV_VAR} starts with '{{' but is not valid JSON: {exc}") from None
        return parse(values, ENV_VAR)
    path = os.path.expanduser(raw)
    where = f"{ENV_VAR} file {path}"
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"{ENV_VAR}={raw!r} is neither a JSON object nor a readable file: {exc}") from None
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            values = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{where}: not valid YAML: {exc}") from None
    else:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON: {exc}") from None
    return parse(values, where)
