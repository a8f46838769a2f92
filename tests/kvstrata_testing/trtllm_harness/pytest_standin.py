"""pytest plugin: install the TensorRT-LLM stand-in (:mod:`.standin`) before tests load the adapter.

``pytest --pyargs kvstrata.conformance_tests --adapter trtllm -p kvstrata_testing.trtllm_harness.pytest_standin``
checks the adapter where TensorRT-LLM is not installed (the stand-in plays the engine's base classes; the
kvstrata side is real). With TensorRT-LLM installed the plugin does nothing and says so.
"""

from __future__ import annotations

import pytest

from . import standin


def pytest_configure(config: pytest.Config) -> None:
    config._kvstrata_trtllm_standin = standin.install()


def pytest_report_header(config: pytest.Config) -> str:
    if getattr(config, "_kvstrata_trtllm_standin", False):
        return ("kvstrata: TensorRT-LLM is not installed; its connector base classes are kvstrata's stand-in "
                f"({standin.__name__}, written from {standin.SOURCE}). No real TensorRT-LLM runs here.")
    return "kvstrata: a real TensorRT-LLM is installed; the stand-in was not used"
