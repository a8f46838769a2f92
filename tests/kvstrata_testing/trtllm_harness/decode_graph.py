"""A decode step of the tiny model captured in a CUDA graph at warm-up, as TensorRT-LLM captures its
decode-only batches before the connector's layer hooks are registered (a replay runs no Python, so no hook).

One request per replay (batch size 1): its token, position and block table are copied into the graph's
static inputs, the graph replays on the current stream, and the logits come out of its static output.
The warm-up and capture write one token's KV into a scratch block that no request ever gets.
"""

from __future__ import annotations

import torch

from .model import Segment, TinyConfig, TinyTPModel


class DecodeGraph:
    def __init__(self, model: TinyTPModel, cfg: TinyConfig, scratch_block: int, device: str) -> None:
        width = cfg.max_ctx // cfg.tokens_per_block
        self.token = torch.zeros(1, dtype=torch.int64, device=device)
        self.segment = Segment(torch.zeros(1, dtype=torch.int64, device=device),
                               torch.full((width,), scratch_block, dtype=torch.int64, device=device))
        self.model = model
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up before capture (cuBLAS handles, kernels)
                self.model.forward(self.token, [self.segment])
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.model.forward(self.token, [self.segment])

    def replay(self, token: int, segment: Segment) -> torch.Tensor:
        self.token.fill_(token)
        self.segment.positions.copy_(segment.positions)
        self.segment.block_table.copy_(segment.block_table)
        self.graph.replay()
        return self.logits.clone()
