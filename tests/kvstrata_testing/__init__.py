"""kvstrata's test support that is not shipped: importable with ``tests/`` on the path (pytest puts it there for
``tests/``; subprocesses and tox's ``-p`` plugins get it through ``PYTHONPATH``). The installed package never
imports it.

* :mod:`.gpu_caches`: GPU caches in each engine's format (GPU tests and benchmarks);
* :mod:`.trtllm_harness`: a TensorRT-LLM stand-in and executor loop for the TensorRT-LLM adapter's tests;
* :mod:`.conformance_selftest`: adapters that each break one conformance rule, for the suite's self-test;
* :mod:`.curve_keys`, :mod:`.tiny_llama`: CURVE key sets and a random-weight Llama for engine tests.
"""
