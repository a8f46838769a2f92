"""A TensorRT-LLM-shaped harness for the adapter, since TensorRT-LLM cannot be installed here.

* :mod:`.standin`: TensorRT-LLM's connector module (base classes, ``SchedulerOutput``, ``RequestData``),
  ``mpi_rank`` and the config objects, registered under TensorRT-LLM's own module names in a test process
  only, and only when the real package is absent. Every class names the TensorRT-LLM source it follows.
* :mod:`.model`: a small torch decoder whose attention reads and writes a TensorRT-LLM-format pool
  ``[blocks, layers, 2, heads*tokens*head]`` (HND), tensor-parallel over its KV heads.
* :mod:`.executor`: TensorRT-LLM 1.2's connector manager and executor loop, in its per-iteration order.
* :mod:`.pytest_standin`: a pytest plugin (``-p kvstrata_testing.trtllm_harness.pytest_standin``) that
  installs the stand-in before the conformance suite loads the adapter.

Nothing here is used by the connector itself; the kvstrata side the harness drives is all real.
"""
