"""The models the planners read, offline: a named shape (`MODELS`) or a transformers
`config.json`, checked (`model_config`) and built without weights (`build_model`), and the
model-state memory of each strategy on it (`memory_plan`: what `hf-lowprec memory` prints and
`hf-lowprec plan` reuses, one source for both).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..strategies.registry import get_strategy

__all__ = ["MODELS", "build_model", "memory_plan", "model_config", "quiet", "rule_options"]


@contextlib.contextmanager
def quiet(*names: str) -> Iterator[None]:
    """Within the scope, the loggers `names` (default: the package's and transformers') say
    errors only; their levels are restored after (a plan's start-up warnings, once per strategy
    and depth, would bury its table)."""
    loggers = [logging.getLogger(name) for name in names or ("hf_lowprec", "transformers")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


# Named model shapes for `memory`: (config class, its arguments, model class), all from transformers.
MODELS: dict[str, tuple[str, dict[str, Any], str]] = {
    "gpt2": ("GPT2Config", {}, "GPT2LMHeadModel"),
    "bert-base": ("BertConfig", {}, "BertForMaskedLM"),
    "roberta-base": (
        "RobertaConfig",
        {"vocab_size": 50265, "max_position_embeddings": 514, "type_vocab_size": 1, "pad_token_id": 1},
        "RobertaForMaskedLM",
    ),
    "llama-7b": (
        "LlamaConfig",
        {
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
        },
        "LlamaForCausalLM",
    ),
    # The device check's end-to-end model (docs/gpu.md): Llama-style, 0.63 B parameters.
    "llama-0.63b": (
        "LlamaConfig",
        {
            "vocab_size": 32000,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 8,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "use_cache": False,
        },
        "LlamaForCausalLM",
    ),
    # The device check's MoE model: Qwen3-MoE-shaped, 0.90 B (64 experts of width 512, top-4).
    "qwen3-moe-0.9b": (
        "Qwen3MoeConfig",
        {
            "vocab_size": 32000,
            "hidden_size": 1024,
            "intermediate_size": 1024,
            "moe_intermediate_size": 512,
            "num_hidden_layers": 8,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_experts": 64,
            "num_experts_per_tok": 4,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
            "use_cache": False,
        },
        "Qwen3MoeForCausalLM",
    ),
    # Llama-3-70B's published shape.
    "llama-3-70b": (
        "LlamaConfig",
        {
            "vocab_size": 128256,
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            "use_cache": False,
        },
        "LlamaForCausalLM",
    ),
    # A Mixture-of-Experts model: 128 experts, top-8, expert width 768 (its published config).
    "qwen3-30b-a3b": (
        "Qwen3MoeConfig",
        {
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "decoder_sparse_step": 1,
            "tie_word_embeddings": False,
        },
        "Qwen3MoeForCausalLM",
    ),
}


# Config fields that count or size something: a model needs each at least 1.
_SIZE_FIELDS = (
    "vocab_size",
    "n_layer",
    "n_head",
    "n_embd",
    "n_positions",
    "n_inner",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "intermediate_size",
    "max_position_embeddings",
)


def model_config(model: str) -> tuple[Any, Any]:
    """The config (a copy of its own: callers may change it) and model class `--model` names (a
    known shape or a config.json), checked; ValueError if bad."""
    config, cls = _checked_config(model)
    return copy.deepcopy(config), cls


@functools.cache
def _checked_config(model: str) -> tuple[Any, Any]:
    """The config and model class `--model` names (a known shape or a config.json), checked; ValueError if bad."""
    import transformers

    if model in MODELS:
        config_cls, kwargs, model_cls = MODELS[model]
        return getattr(transformers, config_cls)(**kwargs), getattr(transformers, model_cls)
    path = Path(model)
    if not path.is_file():
        raise ValueError(f"--model must be one of {sorted(MODELS)} or a path to a config.json; {model!r} is neither")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"--model {model}: not a transformers config.json ({str(err).splitlines()[0]})") from None
    for key in _SIZE_FIELDS:
        value = getattr(config, key, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"--model {model}: {key} must be a positive integer, got {value!r}")
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch) if arch and hasattr(transformers, arch) else transformers.AutoModelForCausalLM
    return config, cls


def build_model(model: str, device: Any = "meta", **overrides: Any) -> torch.nn.Module:
    """The model `model` names (`model_config`), built on `device` ("meta": no weights), with
    `overrides` set on its config (e.g. fewer layers)."""
    import transformers

    config, cls = model_config(model)
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device(device):
        return cls.from_config(config) if cls is transformers.AutoModelForCausalLM else cls(config)


def rule_options(name: str, gpu: Any = None, tokens: int = 8192) -> dict[str, Any]:
    """The options that make strategy `name` keep in BF16 what FP8 would not speed up on `gpu`
    (a `hardware.GPU`) at `tokens` a micro-batch, as it does when it runs there; without a `gpu`
    (or one the table lacks), every layer converted; {} for a strategy without the rule."""
    from ..hardware import GPUS
    from ..strategies.registry import REGISTRY

    if name not in REGISTRY:
        return {}
    fields = {f.name for f in dataclasses.fields(REGISTRY[name][0].Options)}
    if "fp8_layers" not in fields:
        return {}
    if gpu is None:  # no GPU named: every layer, whatever GPU this process happens to have
        return {"fp8_layers": "all"}
    key = next((k for k, g in GPUS.items() if g.name == gpu.name), "")
    return {"fp8_gpu": key, "fp8_tokens": tokens} if key else {"fp8_layers": "all"}


def memory_plan(
    model: str, strategies: list[str], world_size: int = 1, zero_stage: int = 0, gpu: Any = None, tokens: int = 8192
) -> list[dict[str, Any]]:
    """Model-state memory per strategy for `model`, planned on the meta device (no weights allocated).

    Each strategy prepares the meta model and builds its optimizer; the optimizer's own state
    initialisers give the state tensors (`hf_lowprec.report.plan_model_state`). With ZeRO, the
    per-rank share follows `hf_lowprec.report.zero_per_rank`. With a `gpu`, FP8 strategies keep
    in BF16 what FP8 would not speed up there at `tokens` a micro-batch (`rule_options`).
    """
    from ..report import plan_model_state, zero_per_rank

    rows = []
    for name in strategies:
        strategy = get_strategy(name, **rule_options(name, gpu, tokens))
        with quiet("hf_lowprec.fp8"):  # skipped-layer warnings, once per strategy
            prepared = strategy.prepare_model(build_model(model))
        optimizer = strategy.create_optimizer([p for p in prepared.parameters() if p.requires_grad], lr=1e-4)
        plan = plan_model_state(prepared, optimizer)
        row = {"strategy": name, **plan}
        if world_size > 1 or zero_stage:
            refusal = _zero_refusal(name, zero_stage)
            per_rank = zero_per_rank(plan, world_size, zero_stage)
            row["per_rank_total"] = per_rank["total"]
            row["zero"] = refusal or "ok"
        rows.append(row)
    return rows


def _zero_refusal(name: str, stage: int) -> str | None:
    """The support matrix's refusal for `name` under ZeRO `stage` (None where it runs)."""
    if stage == 0:
        return None
    from ..engines.zero import zero_support  # imports without DeepSpeed

    return zero_support(get_strategy(name), stage)
