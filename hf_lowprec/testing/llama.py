"""Llama-shaped configs from transformers (no hub) for the RL tests and benchmarks: one builder, so a
tiny test model and the device check's 0.20 B model differ only in their sizes."""

from __future__ import annotations

from typing import Any

__all__ = ["llama_config"]


def llama_config(
    *,
    vocab: int,
    hidden: int,
    layers: int,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    positions: int = 256,
    **extra: Any,
) -> Any:
    """A `LlamaConfig`: MLP `intermediate` wide (twice `hidden` unset), `kv_heads` key/value heads
    (half the heads unset), `extra` passed on (token ids, ...)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or max(1, heads // 2),
        max_position_embeddings=positions,
        **extra,
    )
