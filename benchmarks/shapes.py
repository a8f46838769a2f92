"""The model shapes the benchmarks load and compute: one GPU's view of each model (its layers, its KV heads, and for
``ttft.py``'s compute its hidden and MLP widths), chosen by name with ``--shape``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shapes:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head: int = 128
    mlp: int = 14336
    vocab: int = 128256
    block: int = 16
    mla: bool = False
    """Multi-head latent attention: the cache holds one latent plane per token (``kv_heads`` 1, ``head`` the
    latent's width), which attention up-projects to each query head's K and V."""
    latent: int = 512
    rope: int = 64
    nope: int = 128
    v_head: int = 128

    @property
    def kv_planes(self) -> int:
        """Planes a cached token has per layer: K and V, or the one latent of MLA."""
        return 1 if self.mla else 2

    def cache_format(self, fmt: str) -> str:
        """The test caches' format for an engine format on this shape (its MLA variant for an MLA model)."""
        if not self.mla:
            return fmt
        if fmt not in MLA_FORMATS:
            raise ValueError(f"engine format {fmt!r} has no MLA cache among the test caches (MLA: "
                             f"{', '.join(MLA_FORMATS)})")
        return MLA_FORMATS[fmt]

    def describe(self) -> str:
        if self.mla:
            return (f"{self.layers} layers, hidden {self.hidden}, {self.heads} q heads, MLA latent {self.latent}+"
                    f"{self.rope} rope (one {self.head}-wide plane cached), MLP {self.mlp}, vocab {self.vocab}, "
                    "bf16 random weights")
        return (f"{self.layers} layers, hidden {self.hidden}, {self.heads} q heads, {self.kv_heads} KV heads x "
                f"{self.head}, MLP {self.mlp}, vocab {self.vocab}, bf16 random weights")


MLA_FORMATS = {"vllm-LBNHC": "vllm-mla", "sglang": "sglang-mla"}
"""An MLA shape's cache per engine format: vLLM's and SGLang's MLA caches (TensorRT-LLM's MLA pool is not among
the test caches, so an MLA shape runs without it)."""

SHAPES = {
    "llama-3.1-8b": Shapes(),
    # one GPU's shard of Llama-3.1-70B served with tensor parallelism 8: many layers, one KV head each, and
    # little compute per layer (no all-reduce is run, so the compute is if anything understated)
    "llama-3.1-70b-tp8": Shapes(layers=80, hidden=8192, heads=8, kv_heads=1, head=128, mlp=3584),
    # a GQA model of another family: Qwen2.5-7B
    "qwen2.5-7b": Shapes(layers=28, hidden=3584, heads=28, kv_heads=4, head=128, mlp=18944, vocab=152064),
    # an MLA model: DeepSeek-V2-Lite (27 layers, 16 heads, a 512-wide latent plus 64 of rope cached per token);
    # its mixture of experts computed as one dense MLP of the active experts' width (6 routed + 2 shared x 1408)
    "deepseek-v2-lite": Shapes(layers=27, hidden=2048, heads=16, kv_heads=1, head=576, mlp=11264, vocab=102400,
                               mla=True),
}
"""The shapes by name (``--shape`` of ``ttft.py``, ``transfer.py``, ``load_timeline.py``)."""

KV_SHAPES = sorted(name for name, shape in SHAPES.items() if not shape.mla)
"""The shapes that cache a K and a V plane per token: those a benchmark without an MLA cache takes."""
