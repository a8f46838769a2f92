"""Test-only start-up hook for every Python process of the SGLang engine tests (on their ``PYTHONPATH``).

SGLang's offline engine spawns its scheduler in a fresh interpreter, where no test code runs; this file is
how the tests' process-wide settings reach it. It installs, each only when its environment variable is set:

* the test-only slice hold (``KVSTRATA_TEST_SLICE_HOLD``, see ``kvstrata.conformance_tests.slice_hold``), which
  holds a chosen load after a chosen slice so an ordering is caught by construction, not by timing;
* the CPU replacements HiCache needs (``KVSTRATA_TEST_SGLANG_HICACHE_CPU``, see ``hicache_cpu.py``).
"""

import os

if os.environ.get("KVSTRATA_TEST_SLICE_HOLD"):
    from kvstrata.conformance_tests.slice_hold import install_from_environment

    install_from_environment()

if os.environ.get("KVSTRATA_TEST_SGLANG_HICACHE_CPU"):
    import hicache_cpu  # beside this file

    hicache_cpu.install()
