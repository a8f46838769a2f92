"""The shared conformance suite every kvstrata engine adapter must pass.

Run it against one adapter::

    pytest --pyargs kvstrata.conformance_tests --adapter NAME
    KVSTRATA_ADAPTER=NAME pytest --pyargs kvstrata.conformance_tests
    tox -e conformance            # the reference adapter, from a kvstrata checkout

NAME is an entry-point name in the ``kvstrata.adapters`` group (an installed
adapter, yours or ours) or a module path ``pkg.module[:attribute]``. Each
test drives the adapter's engine-facing classes through its conformance
driver (published in the suite's own entry-point group ``kvstrata.conformance_drivers``, see
:mod:`kvstrata.conformance_tests.drivers`; for vLLM the connector itself), in
every placement the adapter declares, against a real ``kvstrata serve``
process with a recording proxy on the socket in between, and a failure names
the rule the adapter broke
(``CONFORMANCE RULE <id> BROKEN: ...``; the rules are listed in
:mod:`kvstrata.conformance_tests.rules`).
"""
