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


class StreamGate:
    """Holds a CUDA stream in a state a test chose: everything enqueued on it after the gate waits on the GPU
    until :meth:`open` (the driver's ``cuStreamWaitValue32`` on a pinned host word), however fast the machine.
    Open it before the test ends, or the stream never runs again."""

    def __init__(self, stream: "torch.cuda.Stream") -> None:
        import ctypes

        self.word = torch.zeros(1, dtype=torch.int32).pin_memory()
        lib = ctypes.CDLL("libcuda.so.1")
        wait_value = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
        wait_value.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        rc = wait_value(stream.cuda_stream, self.word.data_ptr(), 1, 0)  # CU_STREAM_WAIT_VALUE_GEQ
        if rc != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed: CUresult {rc}")

    def open(self) -> None:
        self.word[0] = 1

    def __enter__(self) -> "StreamGate":
        return self

    def __exit__(self, *exc: object) -> None:
        self.open()
