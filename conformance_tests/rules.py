"""The rules the conformance suite holds every adapter to, and how a broken one is reported.

Every failure the suite raises starts with ``CONFORMANCE RULE <id> BROKEN:``
so that a person (and the suite's own self-test) can tell at a glance which
promise an adapter broke, whatever test found it.
"""

from __future__ import annotations

from typing import NoReturn

import pytest

RULES: dict[str, str] = {
    "hooks": "the adapter implements every required hook, each marked @hookimpl with the declared signature, "
             "its conformance driver (published in entry-point group kvstrata.conformance_drivers) has the declared methods with the declared arguments in order, and its "
             "engine side loads what the server holds of a prompt's loadable tokens",
    "kv-layout": "kvstrata_describe_kv_cache describes the engine's real cache, and the engine side registers it "
                 "with the server in the placement it was deployed with",
    "retrieve-payload": "every RETRIEVE on the wire has exactly the declared 8 items with the declared types; "
                        "chunk-major sends (None, None, 0) as the tail, layer-major the arrival board and the "
                        "deployed width (engine placement: the load starts from where its LOOKUP found the chunks and "
                        "sends no RETRIEVE, or its RETRIEVE's tail is (None, None, 0); the runtime records the "
                        "deployed width)",
    "early-release": "a layer-major request is released after its first slice, before its transfer completes, "
                     "and exactly once",
    "layer-wait": "the engine side's layer wait blocks until the layer has landed, and every layer read after it "
                  "is byte-correct",
    "fallback": "a retrieve that cannot run layer-major degrades to chunk-major, the runtime's record says why, "
                "and a WARNING names that reason once",
    "failure-reported": "a server that dies or stalls mid-transfer, or a pool that runs dry, never hangs the "
                        "engine: waits are bounded, the engine is told which blocks to recompute, and the "
                        "next retrieve works",
}


def broken(rule: str, message: str) -> NoReturn:
    """Fail the current test, naming the rule and what the adapter did."""
    if rule not in RULES:
        raise KeyError(f"unknown conformance rule {rule!r}")
    pytest.fail(f"CONFORMANCE RULE {rule} BROKEN: {message}\n  (rule: {RULES[rule]})", pytrace=False)


def require(condition: object, rule: str, message: str) -> None:
    if not condition:
        broken(rule, message)
