"""A small torch decoder whose attention really reads TensorRT-LLM's KV pool, tensor-parallel over KV heads.

The pool is TensorRT-LLM's ``[num_blocks, num_layers, 2, heads*tokens_per_block*head]`` with HND inside a
block plane (element ``head*tokens_per_block*dim + token*dim + channel``). Each rank holds its heads'
shard of every layer (its own pool), computes attention over them and a row-parallel slice of the output
projection; the ranks' partial outputs are summed in a fixed order (the all-reduce). So what a layer reads
back from the pool decides the outputs: KV that was not loaded, or loaded wrong, changes the tokens.

Every product is computed one row at a time, so a token's result does not depend on how many other tokens
share its batch: a prompt whose prefix came from kvstrata gives bit-identical logits to one computed whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 97
    hidden: int = 32
    num_kv_heads: int = 4
    head_dim: int = 8
    num_layers: int = 4
    tokens_per_block: int = 16
    max_ctx: int = 192
    """Every query attends over this many key positions, masked past its own: the same shapes whatever the
    batch or step, so an eager decode and a CUDA-graph decode compute the same bits."""
    seed: int = 1234

    @property
    def block_size_elems(self) -> int:
        return self.num_kv_heads * self.tokens_per_block * self.head_dim


@dataclass
class Segment:
    """One request's tokens in a forward: their positions and the request's block table.

    Tensors only, so a decode step can be captured in a CUDA graph and replayed with new values."""

    positions: torch.Tensor
    """int64 query positions (on the model's device)."""
    block_table: torch.Tensor
    """int64 block ids, ``max_ctx / tokens_per_block`` of them (padded with the request's first block)."""


def _rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.cat([x[i:i + 1] @ w for i in range(x.shape[0])]) if x.shape[0] else x.new_zeros(0, w.shape[1])


class DecoderLayer(nn.Module):
    """Named after TensorRT-LLM's ``DecoderLayer`` (tensorrt_llm/_torch/modules/decoder_layer.py:10-34, lines at
    commit c85e8726ad9c0f4f4c182d8959f522c2e1fa50b7, as SOURCE's copy of that file is not stored): the module
    class PyExecutor registers the connector's forward pre- and post-hooks on (it reads ``layer_idx``)."""

    def __init__(self, cfg: TinyConfig, layer_idx: int, rank: int, world: int, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        h = cfg.num_kv_heads // world
        self.heads = h
        cols = slice(rank * h * cfg.head_dim, (rank + 1) * h * cfg.head_dim)
        self.wq = nn.Parameter(weights["wq"][:, cols].clone(), requires_grad=False)
        self.wk = nn.Parameter(weights["wk"][:, cols].clone(), requires_grad=False)
        self.wv = nn.Parameter(weights["wv"][:, cols].clone(), requires_grad=False)
        self.wo = nn.Parameter(weights["wo"][cols, :].clone(), requires_grad=False)
        self.pool: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        cfg, h, d, tpb = self.cfg, self.heads, self.cfg.head_dim, self.cfg.tokens_per_block
        pool = self.pool.view(self.pool.shape[0], cfg.num_layers, 2, h, tpb, d)
        q = _rows(x, self.wq).view(-1, h, d)
        k = _rows(x, self.wk).view(-1, h, d)
        v = _rows(x, self.wv).view(-1, h, d)
        outs = []
        row = 0
        ctx = torch.arange(cfg.max_ctx, device=x.device)
        for seg in segments:
            pos = seg.positions
            n = pos.shape[0]
            blk, off = seg.block_table[pos // tpb], pos % tpb
            pool[blk, self.layer_idx, 0, :, off, :] = k[row:row + n]  # this forward's tokens' KV first
            pool[blk, self.layer_idx, 1, :, off, :] = v[row:row + n]
            kk = pool[seg.block_table[ctx // tpb], self.layer_idx, 0, :, ctx % tpb, :]  # [max_ctx, h, d]
            vv = pool[seg.block_table[ctx // tpb], self.layer_idx, 1, :, ctx % tpb, :]
            for i in range(n):
                scores = torch.einsum("khd,hd->hk", kk, q[row + i]) / d ** 0.5
                scores = scores.masked_fill(ctx > pos[i], float("-inf"))
                outs.append(torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), vv).reshape(1, h * d))
            row += n
        attn = torch.cat(outs) if outs else x.new_zeros(0, h * d)
        return _rows(attn, self.wo)


class RankModel(nn.Module):
    """One tensor-parallel rank's modules: its ``DecoderLayer`` shards over its own pool."""

    def __init__(self, cfg: TinyConfig, rank: int, world: int, weights: list[dict[str, torch.Tensor]]):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg, l, rank, world, weights[l]) for l in range(cfg.num_layers))

    def bind_pool(self, pool: torch.Tensor) -> None:
        for layer in self.layers:
            layer.pool = pool


class TinyTPModel:
    """The whole model over ``world`` ranks: embedding, the ranks' layers (summed), an MLP, the LM head."""

    def __init__(self, cfg: TinyConfig, world: int = 1, device: str | torch.device = "cpu") -> None:
        if cfg.num_kv_heads % world:
            raise ValueError(f"{cfg.num_kv_heads} KV heads do not split over {world} ranks")
        g = torch.Generator().manual_seed(cfg.seed)
        hid, hd = cfg.hidden, cfg.num_kv_heads * cfg.head_dim

        def rnd(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(device)

        weights = [{"wq": rnd(hid, hd, scale=0.5), "wk": rnd(hid, hd, scale=0.5), "wv": rnd(hid, hd, scale=0.5),
                    "wo": rnd(hd, hid, scale=0.3)} for _ in range(cfg.num_layers)]
        self.cfg, self.world = cfg, world
        self.embed = rnd(cfg.vocab, hid, scale=1.0)
        self.mlp = [(rnd(hid, 2 * hid, scale=0.3), rnd(2 * hid, hid, scale=0.3)) for _ in range(cfg.num_layers)]
        self.head = rnd(hid, cfg.vocab, scale=1.0)
        self.ranks = [RankModel(cfg, r, world, weights).to(device) for r in range(world)]

    def forward(self, token_ids: torch.Tensor, segments: list[Segment],
                on_rank: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits of every token; ``on_rank(rank)`` is called before each rank's layer runs (the harness sets
        TensorRT-LLM's notion of "this rank" there, as every rank is its own process in TensorRT-LLM)."""
        x = self.embed[token_ids]
        for l in range(self.cfg.num_layers):
            partial = None
            for r, rank_model in enumerate(self.ranks):
                if on_rank is not None:
                    on_rank(r)
                out = rank_model.layers[l](x, segments)  # __call__: the connector's hooks run here
                partial = out if partial is None else partial + out
            x = x + partial
            w1, w2 = self.mlp[l]
            x = x + _rows(torch.relu(_rows(x, w1)), w2)
        return _rows(x, self.head)
