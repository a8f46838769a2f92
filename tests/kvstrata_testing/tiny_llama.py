"""Test-only: a tiny random-weight Llama written to a directory, for the real-engine tests (vLLM, SGLang).

The weights are drawn wider than transformers' default initialisation: with the default, logits are nearly
uniform and the generated tokens hardly depend on the KV, so a test comparing outputs with and without a
loaded cache could pass whatever was loaded. Imports transformers only when called.
"""

from __future__ import annotations


def write_random_llama(path: str, *, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int = 1000,
                       seed: int = 0) -> None:
    """A float32 ``LlamaForCausalLM`` with ``layers`` layers saved at ``path`` (``config.json`` and weights)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096, torch_dtype="float32", tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
