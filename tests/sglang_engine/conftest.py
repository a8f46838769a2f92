"""The SGLang engine tests' shared fixture: the model and the baseline run without kvstrata."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def work(tmp_path_factory):
    """A random-weight fp32 Llama and each prompt's tokens and logprobs from an engine without kvstrata (one
    engine start, each prompt alone after flush_cache)."""
    pytest.importorskip("sglang", reason="SGLang is not installed (tox -e sglang installs sglang 0.5.23)")
    from engine import PROMPTS, make_model, run_sglang

    tmp = tmp_path_factory.mktemp("sglang")
    make_model(tmp / "model")
    steps = []
    for prompt in PROMPTS.values():
        steps += [{"generate": [prompt]}, {"flush": True}]
    base = run_sglang(tmp, "baseline", steps)
    return tmp, {name: base["steps"][2 * i][0] for i, name in enumerate(PROMPTS)}
