"""TensorRT-LLM is not installable here: these tests install kvstrata's stand-in for its connector module
(``kvstrata_testing.trtllm_harness.standin``) in this test process, for the whole package, and remove it after."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kvstrata_testing.trtllm_harness import standin
from kvstrata.adapters.trtllm.settings import ENV_VAR


@pytest.fixture(scope="package", autouse=True)
def trtllm_standin() -> Iterator[bool]:
    installed = standin.install()
    yield installed
    if installed:
        standin.uninstall()


@pytest.fixture
def deploy(monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """Set kvstrata's TensorRT-LLM settings the way a deployer does (the environment variable); returns the
    record path."""

    def set_settings(server_address: str, **values: Any) -> str:
        record = os.path.join(tempfile.mkdtemp(prefix="kvstrata-trtllm-record-"), "record.jsonl")
        settings = {"server_address": server_address, "layers_per_slice": 1, "record_path": record,
                    "lookup_timeout": 10.0, "layer_wait_timeout": 10.0, **values}
        monkeypatch.setenv(ENV_VAR, json.dumps(settings))
        return record

    return set_settings
