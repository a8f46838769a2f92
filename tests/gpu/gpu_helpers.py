"""Shared GPU-test plumbing: the engine formats and dtypes covered, and the engine loop."""

from __future__ import annotations

import itertools
import random
import time

import torch

# Every engine format, with the dtypes spread across them (fp8 travels as bytes).
FORMAT_CASES = [
    ("vllm-LBNHC", "bfloat16"),
    ("vllm-LBHNC", "float16"),
    ("vllm-mla", "bfloat16"),
    ("sglang", "float32"),
    ("sglang-mla", "float8_e4m3fn"),
    ("trtllm", "float8_e4m3fn"),
    ("trtllm", "bfloat16"),
]
WIDTHS = [1, 2, 3, 8, 32]
_ids = itertools.count(1)


def next_instance_id() -> int:
    return next(_ids)


def shuffled_blocks(first: int, count: int, seed: int) -> list[int]:
    """``count`` block ids from [first, first + count) in random order: no accidental contiguity."""
    blocks = list(range(first, first + count))
    random.Random(seed).shuffle(blocks)
    return blocks


def release_then_read(worker, request_id: str, read_layer, num_layers: int, timeout: float = 60.0) -> tuple[dict, list]:
    """The engine's loop: poll get_finished until released, then per layer wait (on the stream) and read.

    ``read_layer(layer)`` enqueues the read on the current stream right after the
    wait, as an attention layer would; returns (state at release, per-layer reads).
    """
    deadline = time.monotonic() + timeout
    state = None
    while state is None:
        if request_id in worker.get_finished():
            draining = request_id in worker.draining()  # released and its transfer not ended
            state = {"transfer_ended": not draining, "draining": draining}
        elif time.monotonic() > deadline:
            raise TimeoutError(f"{request_id} was never released")
        else:
            time.sleep(0)
    reads = []
    for layer in range(num_layers):
        worker.wait_for_layer(layer)
        reads.append(read_layer(layer))
    worker.wait_all()
    torch.cuda.synchronize()
    return state, reads
