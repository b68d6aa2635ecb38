"""Tiny Mixture-of-Experts models of every MoE architecture the FP8 experts are checked on,
built from their transformers configs (no hub): Qwen3-MoE, Mixtral, OLMoE, gpt-oss, DeepSeek-V3.

Each has `layers` decoder layers, `experts` routed experts with top-`top_k` routing and
expert width `intermediate`; DeepSeek-V3 adds one shared expert and keeps its first layer
dense (`first_k_dense_replace=1`), as the published model does.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MOE_ARCHITECTURES", "moe_config", "tiny_moe"]

MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3")


def moe_config(
    arch: str,
    *,
    vocab: int = 256,
    hidden: int = 64,
    intermediate: int = 32,
    experts: int = 8,
    top_k: int = 2,
    layers: int = 2,
    heads: int = 4,
    **extra: Any,
) -> Any:
    """The transformers config of a tiny `arch` model (`MOE_ARCHITECTURES`)."""
    import transformers as tf

    head_dim = hidden // heads
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1),
        max_position_embeddings=256,
        num_experts_per_tok=top_k,
        tie_word_embeddings=False,
    )
    if arch == "qwen3_moe":
        config = tf.Qwen3MoeConfig(
            **common,
            head_dim=head_dim,
            intermediate_size=2 * intermediate,
            moe_intermediate_size=intermediate,
            num_experts=experts,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    elif arch == "mixtral":
        config = tf.MixtralConfig(
            **common, head_dim=head_dim, intermediate_size=intermediate, num_local_experts=experts
        )
    elif arch == "olmoe":
        config = tf.OlmoeConfig(**common, intermediate_size=intermediate, num_experts=experts)
    elif arch == "gpt_oss":
        config = tf.GptOssConfig(
            **common,
            head_dim=head_dim,
            intermediate_size=intermediate,
            num_local_experts=experts,
            sliding_window=32,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        )
    elif arch == "deepseek_v3":
        config = tf.DeepseekV3Config(
            **{**common, "num_key_value_heads": heads},  # MLA: one key/value head per query head
            intermediate_size=2 * intermediate,
            moe_intermediate_size=intermediate,
            n_routed_experts=experts,
            n_shared_experts=1,
            n_group=2,
            topk_group=2,
            first_k_dense_replace=1,
            q_lora_rank=hidden // 2,
            kv_lora_rank=hidden // 2,  # + the rope dims: 48, a multiple of 16 (FP8 GEMMs)
            qk_rope_head_dim=head_dim,
            qk_nope_head_dim=head_dim,
            v_head_dim=head_dim,
            rope_interleave=False,
        )
    else:
        raise ValueError(f"unknown MoE architecture {arch!r}; choose one of {MOE_ARCHITECTURES}")
    for key, value in extra.items():
        setattr(config, key, value)
    return config


def tiny_moe(arch: str, seed: int = 0, **sizes: Any) -> torch.nn.Module:
    """A tiny `arch` causal LM (FP32, from its config, `seed` for the weights)."""
    from transformers import AutoModelForCausalLM

    config = moe_config(arch, **sizes)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Expert weights are built with torch.empty; transformers 5.24 initialises them for these five
    # classes, and any value it left non-finite gets the model's init scale here.
    std = getattr(config, "initializer_range", 0.02)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name and not torch.isfinite(p).all():
                p.normal_(0.0, std)
    return model
